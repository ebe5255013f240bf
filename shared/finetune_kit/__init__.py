"""Shared utilities for the fine-tuning recipes: data, models, checks, metering, checkpoints."""

__version__ = "0.1.0"
