"""Fused pointwise kernels for a decoder layer's norms and gated MLP (Liger's, where installed)."""

from offloadkit.kernels.liger import LigerKernels, apply_liger_kernels, liger_unusable
from offloadkit.kernels.options import KernelOptions

__all__ = ["KernelOptions", "LigerKernels", "apply_liger_kernels", "liger_unusable"]
