"""The fused attention kernel SDPA runs in each decoder layer: PyTorch's choice, or one named.

``F.scaled_dot_product_attention`` picks a backend per call (on an H100 with torch 2.11: cuDNN
for a long causal call). ``attention_kernel`` names one instead:

- ``cudnn``, ``flash`` (FlashAttention-2 as built into torch), ``efficient``: SDPA pinned to
  that backend inside every attention module's forward (and so in its recompute under
  checkpointing, which must save what the first forward saved);
- ``fa3``, ``fa4``: SDPA's flash backend with FlashAttention-3 or -4 activated through torch's
  provider registry (``torch.nn.attention.activate_flash_attention_impl``). The provider
  replaces the flash kernel for the whole process until ``remove()`` restores torch's own;
  FA3 needs its ``flash_attn_interface`` build and compute capability 9.0, FA4 the
  ``flash-attn-4`` package (CuTe DSL) and capability 9.0 or 10.0.

Every kernel is exact attention; they differ by rounding (``benchmarks/attention_kernels.py``
holds each against the default on the same inputs and times them at a model's lengths:
choose by that measurement). The kernels keep the same outputs for backward (the attention
output and its log-sum-exp), so kept attention outputs, head groups and context parallelism
work with each.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
from torch import nn

from offloadkit.models.blocks import attention_modules
from offloadkit.models.forwards import ForwardWraps
from offloadkit.models.heads import unwrap_model

__all__ = [
    "ATTENTION_KERNELS",
    "AttentionKernel",
    "apply_attention_kernel",
    "attention_kernel_unusable",
    "running",
    "sdpa_context",
]

ATTENTION_KERNELS = ("auto", "cudnn", "flash", "efficient", "fa3", "fa4")
_MARK = "_offloadkit_attention_kernel"
# Provider name in torch's registry, the module it imports, the compute capabilities it runs on.
_PROVIDERS = {"fa3": ("FA3", "flash_attn_interface", (9,)), "fa4": ("FA4", "flash_attn.cute", (9, 10))}


def sdpa_context(kernel: str):
    """A context in which SDPA calls run ``kernel`` (a null context for ``auto``)."""
    if kernel == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    return sdpa_kernel([backend.get(kernel, SDPBackend.FLASH_ATTENTION)])


def _module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # a parent package that is missing, or fails as it is imported
        return False


def attention_kernel_unusable(kernel: str, model: nn.Module | None = None) -> str | None:
    """Why ``kernel`` cannot run here (on ``model``'s attention, when given); None: it can."""
    if kernel not in ATTENTION_KERNELS:
        return f"no kernel named {kernel!r} (one of {', '.join(ATTENTION_KERNELS)})"
    if kernel == "auto":
        return None
    if model is not None:
        impl = getattr(getattr(unwrap_model(model), "config", None), "_attn_implementation", "sdpa")
        if impl not in (None, "sdpa"):
            return f"the model's attention is {impl!r}, not SDPA (load it with attn_implementation='sdpa')"
    if not torch.cuda.is_available():
        return None if kernel == "flash" else "it needs a CUDA GPU"  # SDPA has a flash kernel for CPUs
    if kernel in _PROVIDERS:
        provider, module, capabilities = _PROVIDERS[kernel]
        from torch.nn import attention

        if provider not in getattr(attention, "list_flash_attention_impls", lambda: [])():
            return f"torch {torch.__version__} has no {provider} provider (torch.nn.attention)"
        major = torch.cuda.get_device_capability()[0]
        if major not in capabilities:
            return f"{provider} runs on compute capability {' or '.join(f'{c}.0' for c in capabilities)}, not {major}.x"
        if not _module_found(module):
            package = "flash-attn-4" if kernel == "fa4" else "FlashAttention-3 (its hopper/ build)"
            return f"{module} is not installed (install {package})"
    return None


def _activate(kernel: str) -> str | None:
    """Activate ``kernel``'s flash provider (FA3, FA4) in torch's registry; its name, or None."""
    if kernel not in _PROVIDERS:
        return None
    from torch.nn.attention import activate_flash_attention_impl

    provider = _PROVIDERS[kernel][0]
    activate_flash_attention_impl(provider)
    return provider


def _restore(provider: str) -> None:
    """Torch's own flash kernel again, if ``provider`` is still the active one."""
    from torch.nn import attention

    restore = getattr(attention, "restore_flash_attention_impl", None)
    current = getattr(attention, "current_flash_attention_impl", lambda: None)()
    if restore is not None and current == provider:
        restore()


@contextlib.contextmanager
def running(kernel: str):
    """SDPA calls inside run ``kernel`` (its provider active for the duration)."""
    provider = _activate(kernel)
    try:
        with sdpa_context(kernel):
            yield
    finally:
        if provider is not None:
            _restore(provider)


class AttentionKernel:
    """What :func:`apply_attention_kernel` attached; ``remove()`` restores the modules (and
    torch's own flash kernel where a provider was activated).

    Attributes:
        kernel: the kernel's name.
        modules: ``(qualified name, attention module)`` pairs wrapped.
    """

    def __init__(self, kernel: str, modules: list[tuple[str, nn.Module]]) -> None:
        self.kernel, self.modules = kernel, modules
        self._wraps = ForwardWraps(_MARK)
        self._provider: str | None = None

    def _attach(self) -> None:
        self._wraps.wrap_all(
            self.modules,
            lambda _, module: functools.partial(self._call, module.forward),
            "already has its attention kernel named",
        )
        try:
            self._provider = _activate(self.kernel)
        except Exception:
            self._wraps.remove()
            raise

    def _call(self, original, *args, **kwargs):
        with sdpa_context(self.kernel):
            return original(*args, **kwargs)

    def remove(self) -> None:
        """Restore every module's forward, and torch's flash kernel if this handle's provider
        is still the active one."""
        self._wraps.remove()
        if self._provider is not None:
            _restore(self._provider)
            self._provider = None


def apply_attention_kernel(model: nn.Module, kernel: str) -> AttentionKernel:
    """Run every decoder layer's SDPA calls with ``kernel`` (see the module's docstring).

    Args:
        model: a Hugging Face model (PEFT wrappers are looked through) whose decoder layers
            have an attention module (``self_attn``, ``attn`` or ``attention``).
        kernel: one of :data:`ATTENTION_KERNELS` other than ``auto``.

    Returns:
        An :class:`AttentionKernel`; ``handle.remove()`` restores the modules.

    Raises:
        ValueError: an unknown kernel, or one that cannot run here (saying why).

    Example:
        >>> handle = apply_attention_kernel(model, "flash")
        >>> model(input_ids=ids, labels=ids).loss.backward()
        >>> handle.remove()
    """
    if kernel == "auto":
        raise ValueError("kernel='auto' leaves SDPA's own choice: do not apply")
    why = attention_kernel_unusable(kernel, model)
    if why is not None:
        raise ValueError(f"attention kernel {kernel!r} cannot run here: {why}")
    modules = attention_modules(model)
    handle = AttentionKernel(kernel, modules)
    handle._attach()
    return handle
