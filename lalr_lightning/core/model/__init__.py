"""The model's anatomy and calling it outside the training loop: its layers and blocks, which norm layers
keep their statistics, a batch's loss, a fixed probe batch, and taps on the blocks."""
