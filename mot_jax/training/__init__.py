"""Training: input pipeline, objective, optimizer, checkpoints and the loop."""
