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
  ``flash-attn-4`` package (CuTe DSL) and capability 9.0 or 10.0. FA4 goes through torch's
  provider with an interface that returns what torch unpacks whatever the release returns
  (``offloadkit/runtime/flash_providers.py``). Before it is used, a provider runs one small
  causal call forward and backward against attention in fp32: one that fails it, or differs,
  is refused with what happened.

The named kernel comes first in SDPA's priority order and the others after it: a call it
cannot take (a mask, for the flash kernels) falls back, the same way in forward and in the
recompute. Every kernel is exact attention; they differ by rounding
(``benchmarks/attention_kernels.py`` holds each against the default on the same inputs and
times them at a model's lengths: choose by that measurement). The kernels keep the same
outputs for backward (the attention output and its log-sum-exp), so kept attention outputs
and head groups work with each. Under context parallelism the ring attention picks its own
kernels (flash or cuDNN), and the key has no effect.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch
from torch import nn

from offloadkit.models.blocks import attention_modules
from offloadkit.models.forwards import ForwardWraps
from offloadkit.models.heads import unwrap_model
from offloadkit.runtime.flash_providers import FA4_MODULE, FA4_PROVIDER, register_fa4

__all__ = [
    "ATTENTION_KERNELS",
    "AttentionKernel",
    "apply_attention_kernel",
    "attention_kernel_unusable",
    "probe_error",
    "running",
    "sdpa_context",
]

ATTENTION_KERNELS = ("auto", "cudnn", "flash", "efficient", "fa3", "fa4")
_MARK = "_offloadkit_attention_kernel"
# Provider name in torch's registry, the module the provider calls, the compute capabilities
# it runs on.
_PROVIDERS = {"fa3": ("FA3", "flash_attn_interface", (9,)), "fa4": (FA4_PROVIDER, FA4_MODULE, (9, 10))}
# The probe's shape (batch, heads, tokens, head dim) and how far from attention in fp32 a bf16
# kernel may land, relative to the largest value: a few of bf16's roundings.
_PROBE_SHAPE = (1, 2, 256, 128)
_PROBE_TOLERANCE = 2e-2
# The attention implementation context parallelism switches the model to (parallel/context.py).
_RING = "offloadkit_context_parallel"


def sdpa_context(kernel: str):
    """A context in which SDPA calls prefer ``kernel`` (a null context for ``auto``): first in
    SDPA's priority order, the others after it, so a call it cannot take (a mask for the flash
    kernels, say) falls back the same way in forward and in the recompute."""
    if kernel == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    pinned = first.get(kernel, SDPBackend.FLASH_ATTENTION)
    rest = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel([pinned, *(b for b in rest if b != pinned)], set_priority=True)


def _provider_import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # not installed, or its own imports fail (FA4 without its CuTe DSL)
        return f"{type(exc).__name__}: {exc}"
    return None


def attention_kernel_unusable(kernel: str, model: nn.Module | None = None) -> str | None:
    """Why ``kernel`` cannot run here (on ``model``'s attention, when given); None: it can."""
    if kernel not in ATTENTION_KERNELS:
        return f"no kernel named {kernel!r} (one of {', '.join(ATTENTION_KERNELS)})"
    if kernel == "auto":
        return None
    if model is not None:
        config = getattr(unwrap_model(model), "config", None)
        impl = getattr(config, "_attn_implementation", "sdpa")
        if impl == _RING:
            return "context parallelism runs its own ring attention kernels (flash or cuDNN)"
        if impl not in (None, "sdpa"):
            return f"the model's attention is {impl!r}, not SDPA (load it with attn_implementation='sdpa')"
        heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
        if kernel == "efficient" and kv_heads not in (None, heads):
            return "the efficient kernel takes no grouped key/value heads"
    if not torch.cuda.is_available():
        return None if kernel == "flash" else "it needs a CUDA GPU"  # SDPA has a flash kernel for CPUs
    major = torch.cuda.get_device_capability()[0]
    if kernel in ("cudnn", "flash") and major < 8:
        return f"it needs compute capability 8.0 or later, not {major}.x"
    if kernel in _PROVIDERS:
        provider, module, capabilities = _PROVIDERS[kernel]
        from torch.nn import attention

        if kernel == "fa4" and register_fa4() is None:
            return f"torch {torch.__version__} has no FA4 provider (torch.nn.attention)"
        if provider not in getattr(attention, "list_flash_attention_impls", lambda: [])():
            return f"torch {torch.__version__} has no {provider} provider (torch.nn.attention)"
        if not hasattr(attention, "restore_flash_attention_impl"):
            return f"torch {torch.__version__} cannot restore its own flash kernel after {provider}"
        if major not in capabilities:
            return f"{provider} runs on compute capability {' or '.join(f'{c}.0' for c in capabilities)}, not {major}.x"
        failed = _provider_import_error(module)
        if failed is not None:
            package = "flash-attn-4" if kernel == "fa4" else "FlashAttention-3 (its hopper/ build)"
            return f"{module} does not import ({failed}; install {package})"
        return probe_error(kernel, torch.device("cuda", torch.cuda.current_device()))
    return None


# Probe results by (kernel, device): a provider that passed or failed stays so for the process.
_PROBED: dict[tuple[str, torch.device], str | None] = {}


def probe_error(kernel: str, device: torch.device) -> str | None:
    """Why ``kernel`` fails one small causal attention call, forward and backward, on
    ``device``, or lands farther than bf16's rounding from attention in fp32; None: it passes.
    (An installed provider can import and still not run: a release whose functions torch's
    provider calls with arguments or results it does not expect.) A provider's call is pinned
    to SDPA's flash backend, the one it replaces, so a call flash cannot take fails rather than
    passing on another kernel. Remembered per kernel and device, except a probe that ran out
    of memory."""
    key = (kernel, device)
    if key not in _PROBED:
        try:
            # Whatever the caller's grad mode: the probe needs its backward.
            with torch.inference_mode(False), torch.enable_grad():
                _PROBED[key] = _probe(kernel, device)
        except torch.cuda.OutOfMemoryError as exc:
            return f"{kernel}'s probe call ran out of memory ({exc})"
    return _PROBED[key]


def _probe(kernel: str, device: torch.device) -> str | None:
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(_PROBE_SHAPE, device=device, generator=generator).to(torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    grad_out = torch.randn(_PROBE_SHAPE, device=device, generator=generator).to(torch.bfloat16)
    name = _PROVIDERS[kernel][0] if kernel in _PROVIDERS else kernel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pinned = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if kernel in _PROVIDERS else contextlib.nullcontext()
    try:
        with running(kernel), pinned:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # the provider's own failure, whatever its kind: reported, not raised
        return f"{name} fails a probe call ({type(exc).__name__}: {exc})"
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out_ref = _causal_attention(*exact)
    grads_ref = torch.autograd.grad(out_ref, exact, grad_out.float())
    for what, got, ref in zip(("output", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref)):
        diff = (got.float() - ref).abs().max().item()
        if not diff <= _PROBE_TOLERANCE * max(1.0, ref.abs().max().item()):
            return f"{name}'s {what} differs from causal attention in fp32 by {diff:.2e} on a probe call"
    return None


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), causal) v, written out: the probe's reference."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(above, float("-inf")).softmax(-1) @ v


def _activate(kernel: str) -> tuple[str, str | None] | None:
    """Activate ``kernel``'s flash provider (FA3, FA4) in torch's registry: (its name, the
    provider active before), or None for a kernel without one."""
    if kernel not in _PROVIDERS:
        return None
    from torch.nn.attention import activate_flash_attention_impl, current_flash_attention_impl

    if kernel == "fa4":
        register_fa4()
    provider, before = _PROVIDERS[kernel][0], current_flash_attention_impl()
    activate_flash_attention_impl(provider)
    return provider, before


def _restore(activated: tuple[str, str | None]) -> None:
    """The provider active before ``activated`` again (torch's own flash kernel if none), if
    ``activated``'s is still the active one."""
    from torch.nn.attention import (
        activate_flash_attention_impl,
        current_flash_attention_impl,
        restore_flash_attention_impl,
    )

    provider, before = activated
    if current_flash_attention_impl() != provider:
        return  # someone activated another since: theirs stays
    if before is None:
        restore_flash_attention_impl()
    else:
        activate_flash_attention_impl(before)


@contextlib.contextmanager
def running(kernel: str):
    """SDPA calls inside prefer ``kernel`` (its provider active for the duration)."""
    activated = _activate(kernel)
    try:
        with sdpa_context(kernel):
            yield
    finally:
        if activated is not None:
            _restore(activated)


class AttentionKernel:
    """What :func:`apply_attention_kernel` attached; ``remove()`` restores the modules (and
    the flash provider active before, or torch's own flash kernel, where one was activated).

    Attributes:
        kernel: the kernel's name.
        modules: ``(qualified name, attention module)`` pairs wrapped.
    """

    def __init__(self, kernel: str, modules: list[tuple[str, nn.Module]]) -> None:
        self.kernel, self.modules = kernel, modules
        self._wraps = ForwardWraps(_MARK)
        self._provider: tuple[str, str | None] | None = None

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
        """Restore every module's forward, and the flash provider active before this handle's
        (torch's own flash kernel if none) while this handle's is still the active one."""
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
