"""Evaluation: tasks, metrics, baselines and reports."""
