"""A device-side sleep (a private PyTorch function), for race tests that delay copies."""

from __future__ import annotations

import torch

__all__ = ["device_sleep"]


def device_sleep(cycles: int) -> None:
    """Spin the current stream for about ``cycles`` GPU clock cycles."""
    torch.cuda._sleep(cycles)
