"""Accelerator, stream and pinned-memory primitives shared by every tier and engine."""

from offloadkit.runtime.device import (
    accelerator_available,
    current_stream,
    host_register,
    host_unregister,
    is_accelerator_tensor,
)

__all__ = [
    "accelerator_available",
    "current_stream",
    "host_register",
    "host_unregister",
    "is_accelerator_tensor",
]
