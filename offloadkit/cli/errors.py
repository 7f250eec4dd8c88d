"""Errors of the ``offloadkit`` command that are not configuration mistakes."""

from __future__ import annotations

__all__ = ["TrainingFailedError"]


class TrainingFailedError(RuntimeError):
    """Training ran but its result is not usable (a NaN or infinite loss); nothing was saved.
    The command prints the message as one line and exits with status 1."""
