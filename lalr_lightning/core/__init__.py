"""Pure PyTorch for every method, no Lightning: the model's anatomy (``model``), the machinery the methods
share (``runtime``), and one folder per method family's math (``spectral``, ``pruning``, ``selection``,
``linearization``). docs/design.md draws the layout."""
