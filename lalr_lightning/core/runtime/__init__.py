"""The machinery every method shares: the one owner of parameter and optimizer changes (``control``),
tensors kept beside parameters (``placement``), weights across ranks (``shards``, ``handsync``), streamed
safetensors checkpoints, the package's errors and a decision as plain data."""
