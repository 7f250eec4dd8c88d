"""The fused attention kernels' ATen ops, and a dispatch mode that sees their calls (PyTorch's
dispatch-mode base is a private module, kept here).

``F.scaled_dot_product_attention`` picks a backend and calls one of these ops; below autograd
a :class:`AttentionCalls` mode sees the call and may hand back outputs of its own. Autograd
then builds the op's own backward node around them, exactly as for the kernel's outputs.
"""

from __future__ import annotations

from typing import Callable

import torch

from offloadkit.runtime.dispatch import TorchDispatchMode

__all__ = ["ATTENTION_OPS", "AttentionCalls", "LARGE_OUTPUTS", "dropout_of", "sdpa_backend"]


def _ops() -> frozenset:
    names = (
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


ATTENTION_OPS = _ops()
# Outputs of every op above that grow with the sequence: the attention output [B, H, S, D]
# and its log-sum-exp [B, H, S]; the rest are RNG state, offsets and empty placeholders.
LARGE_OUTPUTS = (0, 1)


def dropout_of(op, args, kwargs) -> float:
    """The ``dropout_p`` an attention op was called with (0.0 when it takes none)."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            if "dropout_p" in kwargs:
                return float(kwargs["dropout_p"])
            return float(args[i]) if i < len(args) else float(arg.default_value or 0.0)
    return 0.0


class AttentionCalls(TorchDispatchMode):
    """Within it, each fused attention kernel call goes to ``on_call(op, args, kwargs, run)``,
    whose return value is the call's outputs (``run()`` runs the kernel); every other op runs
    as it is.

    Args:
        on_call: the handler of one attention call.
    """

    def __init__(self, on_call: Callable) -> None:
        super().__init__()
        self.on_call = on_call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ATTENTION_OPS:
            return self.on_call(func, args, kwargs, lambda: func(*args, **kwargs))
        return func(*args, **kwargs)


_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


def sdpa_backend(query, key, value, is_causal: bool = True, enable_gqa: bool = False) -> str:
    """The kernel ``F.scaled_dot_product_attention`` picks for these inputs (no mask, no
    dropout), as PyTorch's own dispatch decides it: "cudnn", "flash", "efficient" or "math"."""
    choice = torch.ops.aten._fused_sdp_choice(query, key, value, None, 0.0, is_causal, enable_gqa=enable_gqa)
    return _BACKEND_NAMES.get(int(choice), f"backend {int(choice)}")
