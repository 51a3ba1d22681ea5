"""Training: input pipeline, objective, optimizer, checkpoints, the run's set-up, trainer, channel search and
report, and the loop."""
