"""The options of the fused pointwise kernels, read from Axolotl's config keys of the same names."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.options import Options, option

__all__ = ["AttentionKernelOptions", "KernelOptions"]


@dataclass
class KernelOptions(Options):
    """Which pointwise parts of a decoder layer run as Liger's fused Triton kernels.

    Each is within the kernel's tolerance of the model's own eager code, not bitwise: the
    kernels reduce and round in other places (``tests/gpu/test_liger_kernels_cuda.py`` holds
    them to it). They need ``liger-kernel`` (``pip install 'offloadkit[liger]'``) and a GPU;
    without either, or on a model with no module of a known class, the key has no effect (a
    note says so).

    Attributes:
        rms_norm: ``liger_rms_norm``: every RMSNorm of a known class (Llama, Mistral, Mixtral,
            Qwen2/3, Phi-3, Granite: ``weight * normed``; Gemma 1-3: ``(1 + weight) * normed``)
            runs as one kernel each way, saving its 16-bit input and an fp32 scale per token
            instead of an fp32 copy of its input. Unset (the default): off, unless
            ``offload_plan: auto`` turns it on where it applies; ``false`` keeps it off then too.
        glu_activation: ``liger_glu_activation``: every gated MLP of a known class
            (``down(silu(gate(x)) * up(x))``: Llama, Mistral, Qwen2/3, Granite, OLMo-2) computes
            ``silu(gate) * up`` in one kernel, saving gate and up and recomputing the SiLU in
            backward (one ``[S, intermediate]`` tensor fewer a layer). Unset: as ``rms_norm``.
    """

    rms_norm: bool | None = option(None, "liger_rms_norm")
    glu_activation: bool | None = option(None, "liger_glu_activation")

    def __post_init__(self) -> None:
        for name in ("rms_norm", "glu_activation"):
            if getattr(self, name) is not None:
                self._bool(name)


@dataclass
class AttentionKernelOptions(Options):
    """Which fused attention kernel each decoder layer's SDPA calls run.

    Attributes:
        kernel: ``attention_kernel``: ``auto`` (the default: PyTorch's own choice per call),
            ``cudnn``, ``flash`` (FlashAttention-2 as built into torch), ``efficient``, or
            ``fa3`` / ``fa4`` (FlashAttention-3 / -4 through torch's provider registry, in
            place of the flash kernel for the whole process until the run is closed; FA4
            needs ``flash-attn-4``, both a Hopper GPU or, for FA4, a Blackwell one). The kernel
            comes first in SDPA's priority order in each attention module (a call it cannot
            take falls back). Every kernel is exact attention, each rounding its own way.
            ``offloadkit plan --measure`` times each one this machine runs and writes the
            fastest. A kernel that cannot run here (no GPU, not installed, a model whose
            attention is not SDPA, context parallelism's ring attention, grouped key/value
            heads for ``efficient``, a provider that fails a small probe call against
            attention in fp32) leaves PyTorch's choice, and a note says why.
    """

    kernel: str = option("auto", "attention_kernel")

    def __post_init__(self) -> None:
        from offloadkit.kernels.attention import ATTENTION_KERNELS

        if self.kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"{self.named('kernel')}={self.kernel!r} is not a kernel offloadkit knows; "
                f"use one of {', '.join(ATTENTION_KERNELS)} (auto: PyTorch's own choice)"
            )
