"""Fused kernels in a decoder layer: Liger's for its norms and gated MLP (where installed), and
the attention kernel its SDPA calls run."""

from offloadkit.kernels.attention import AttentionKernel, apply_attention_kernel, attention_kernel_unusable
from offloadkit.kernels.liger import LigerKernels, apply_liger_kernels, liger_unusable
from offloadkit.kernels.options import AttentionKernelOptions, KernelOptions

__all__ = [
    "AttentionKernel",
    "AttentionKernelOptions",
    "KernelOptions",
    "LigerKernels",
    "apply_attention_kernel",
    "apply_liger_kernels",
    "attention_kernel_unusable",
    "liger_unusable",
]
