"""The ``offloadkit`` command: ``train``, ``bench`` and ``demo``."""

from offloadkit.cli.main import main

__all__ = ["main"]
