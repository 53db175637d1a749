"""The package version: one place, read by pyproject.toml and by checkpoints."""

__version__ = "0.2.0"
