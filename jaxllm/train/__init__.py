"""Training: data, optimizer, checkpoints and the loop."""
