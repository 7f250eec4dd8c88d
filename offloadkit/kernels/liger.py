"""Liger's fused Triton kernels for a decoder layer's RMSNorms and gated MLP, on the instances.

A Hugging Face Llama-family layer runs its pointwise work as separate eager kernels: each
RMSNorm upcasts its input to fp32, squares, reduces, scales and casts back (five passes over
``[S, H]``, an fp32 copy saved for backward), and the MLP's ``silu(gate) * up`` is two passes
over ``[S, intermediate]`` that save three tensors. Liger's kernels do each in one pass and
save less (the norm's 16-bit input and an fp32 scale a token; gate and up). At 64K tokens
this is a fifth of an 8B LoRA layer's GPU time.

Only modules of known classes are replaced, each by a ``forward`` on the instance (no class
or module-level function is patched; :meth:`LigerKernels.remove` puts them back): their
arithmetic is the one the kernel reproduces (Llama's ``weight * normed.to(dtype)``, Gemma's
``(1 + weight) * normed`` in fp32). A call the kernel would not compute the same way (a CPU
tensor, a DTensor, a Llama-style norm whose weight has another dtype than its input) runs
the module's own forward. The rotary embedding stays eager: it is a module-level function
of the model's file, which only a global patch could replace.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from offloadkit.models.forwards import ForwardWraps

__all__ = ["GATED_MLPS", "NORMS", "LigerKernels", "applicable", "apply_liger_kernels", "liger_ops", "liger_unusable"]

# RMSNorm class -> (offset added to the weight, Liger's casting mode, the eps attribute).
NORMS: dict[str, tuple[float, str, str]] = {
    **{
        f"{family}RMSNorm": (0.0, "llama", "variance_epsilon")
        for family in ("Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3", "Qwen3Moe", "Phi3", "Granite")
    },
    **{f"{family}RMSNorm": (1.0, "gemma", "eps") for family in ("Gemma", "Gemma2", "Gemma3")},
}
# MLPs whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; fused where act_fn is SiLU.
GATED_MLPS = frozenset(
    f"{family}MLP" for family in ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3Moe", "Granite", "Olmo2")
)
_SILU = frozenset({"SiLU", "SiLUActivation"})
_MARK = "_offloadkit_liger"


def liger_unusable() -> str | None:
    """Why Liger's kernels cannot run in this process (None: they can)."""
    from offloadkit.extras import available

    if not available("liger_kernel"):
        return "liger-kernel is not installed (pip install 'offloadkit[liger]')"
    if not torch.cuda.is_available():
        return "Liger's kernels need a GPU"
    return None


def liger_ops() -> tuple[Any, Any]:
    """Liger's ``(LigerRMSNormFunction, LigerSiLUMulFunction)``.

    Raises:
        MissingExtraError: liger-kernel is not installed.
    """
    return _ops()


@functools.cache
def _ops() -> tuple[Any, Any]:
    from offloadkit.extras import needs

    with needs("Liger's fused kernels", extra="liger"):
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    return LigerRMSNormFunction, LigerSiLUMulFunction


def _plain(*tensors: torch.Tensor) -> bool:
    """Plain CUDA tensors (not DTensors or other subclasses): what the kernels take."""
    return all(type(t) is torch.Tensor or type(t) is nn.Parameter for t in tensors) and tensors[0].is_cuda


def _norm_forward(module: nn.Module, offset: float, casting: str, eps_attr: str):
    original = module.forward
    rms_norm = _ops()[0]

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        # Llama's form multiplies in the weight's dtype: the kernel's output takes the input's.
        if not _plain(hidden_states, weight) or (casting == "llama" and weight.dtype != hidden_states.dtype):
            return original(hidden_states)
        # in_place=False: the incoming gradient may be read elsewhere (a residual's branch).
        return rms_norm.apply(hidden_states, weight, getattr(module, eps_attr), offset, casting, False)

    return forward


def _mlp_forward(module: nn.Module):
    original = module.forward
    silu_mul = _ops()[1]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _plain(x):
            return original(x)
        gate, up, down = module.gate_proj, module.up_proj, module.down_proj
        return down(silu_mul.apply(gate(x), up(x)))  # type: ignore[operator]

    return forward


def _why_not_mlp(module: nn.Module) -> str | None:
    act = getattr(module, "act_fn", None)
    if type(act).__name__ not in _SILU:
        return f"activation {type(act).__name__}, not SiLU"
    if not all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")):
        return "no gate_proj, up_proj and down_proj"
    return None


class LigerKernels:
    """The norms and MLPs one :func:`apply_liger_kernels` gave Liger's kernels.

    Attributes:
        norms / mlps: the names of the modules replaced.
        skipped: name -> why, for gated MLPs of a known class left eager.
    """

    def __init__(self) -> None:
        self.norms: list[str] = []
        self.mlps: list[str] = []
        self.skipped: dict[str, str] = {}
        self._wraps = ForwardWraps(_MARK)

    def remove(self) -> None:
        """Give every module back its own forward."""
        self._wraps.remove()
        self.norms.clear()
        self.mlps.clear()


def applicable(model: nn.Module) -> tuple[bool, bool]:
    """Whether ``model`` has an RMSNorm, and a gated MLP, that the kernels reproduce."""
    norms = mlps = False
    for module in model.modules():
        kind = type(module).__name__
        norms = norms or kind in NORMS
        mlps = mlps or (kind in GATED_MLPS and _why_not_mlp(module) is None)
    return norms, mlps


def apply_liger_kernels(model: nn.Module, rms_norm: bool = True, glu_activation: bool = True) -> LigerKernels:
    """Run ``model``'s RMSNorms and gated MLPs of known classes (:data:`NORMS`,
    :data:`GATED_MLPS`) through Liger's kernels. Apply them before anything that wraps those
    modules' forwards (the tiled MLP and norms run the kernels' forward by shards).

    Raises:
        MissingExtraError: liger-kernel is not installed.
        ValueError: a module is already replaced by an earlier call (``remove()`` it first),
            or has a forward of its own on the instance, which the kernel would bypass.
    """
    _ops()  # the import error first, before any module is touched
    handle = LigerKernels()
    norms, mlps = [], []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if rms_norm and kind in NORMS:
            norms.append((name, module))
        elif glu_activation and kind in GATED_MLPS:
            why = _why_not_mlp(module)
            if why is None:
                mlps.append((name, module))
            else:
                handle.skipped[name] = why
    for name, module in norms + mlps:
        if "forward" in module.__dict__ and not handle._wraps.holds(module):
            raise ValueError(
                f"{name} already has a forward of its own on the instance (a tiled module?), which Liger's kernel "
                "would bypass; apply Liger's kernels first"
            )

    def make(name: str, module: nn.Module):
        kind = type(module).__name__
        return _norm_forward(module, *NORMS[kind]) if kind in NORMS else _mlp_forward(module)

    handle._wraps.wrap_all(norms + mlps, make, "already runs Liger's kernels")
    handle.norms = [n for n, _ in norms]
    handle.mlps = [n for n, _ in mlps]
    return handle
