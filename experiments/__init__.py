"""Experiments: one package per task (its harness, data, warm-up and config)."""
