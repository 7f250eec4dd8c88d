"""Operator overload types (for naming ops in selective checkpointing policies)."""

from torch._ops import OpOverload, OpOverloadPacket

__all__ = ["OpOverload", "OpOverloadPacket"]
