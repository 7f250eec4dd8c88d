"""Attention over groups of key/value heads: one fused-kernel call per group.

At long context a layer's GPU peak is its attention backward: besides the saved q, k, v,
output and log-sum-exp, the kernel's backward takes a workspace as large as the query in
fp32, twice over (32,896 bytes a token for Llama-3-8B's 32 heads with cuDNN on an H100, 23
GiB at 750K tokens), and returns the three input gradients at once. Heads do not interact
in attention, so the same kernel can run one group of key/value heads at a time (with its
query heads under grouped-query attention): forward concatenates the groups' outputs, and in
backward each group's kernel holds its group's workspace only, 1/G of the whole.

:func:`apply_attention_head_groups` wraps each decoder layer's attention module so that,
inside it, ``F.scaled_dot_product_attention`` runs that way (a ``TorchFunctionMode`` scoped
to the module's forward; nothing global is patched). Each group is an ordinary SDPA call
with the kernel PyTorch picks, so every backend, the checkpoint's recompute and
kept attention outputs see ordinary kernel calls. A group count that does not divide the
key/value heads falls to its largest divisor that does; calls with dropout, 3-D inputs, or
where that divisor is 1 run whole. The outputs are laid out as the kernels lay
theirs out (``[B, S, H, D]`` memory), so a caller's ``transpose(1, 2)`` copies nothing.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from offloadkit.models.blocks import attention_modules
from offloadkit.models.forwards import ForwardWraps
from offloadkit.runtime.dtensor import DTensorLayout, is_dtensor, local_tensor
from offloadkit.runtime.ring import SDPA, is_sdpa

__all__ = ["AttentionHeadGroups", "apply_attention_head_groups", "grouped_attention", "kv_head_groups"]

_MARK = "_offloadkit_head_groups"


class _GradInOutputLayout(torch.autograd.Function):
    """Identity whose backward hands the gradient on with the output's own strides.

    A group's output gradient is a slice of the joined output's gradient: wider rows than the
    output the group's kernel wrote, or dimensions ordered otherwise, as the layer above
    produced it. PyTorch's cuDNN attention (torch 2.11) builds its backward graph for the
    gradient's strides at the first call and caches it under the query/key/value strides
    alone; a later call with the same inputs and a gradient laid out otherwise runs the cached
    graph on it: wrong gradients (seen on an H100), or reads out of bounds (most likely the
    illegal memory access seen once on an H200). The output's own strides are the one layout
    the cache always agrees with. A gradient laid out otherwise is copied into them, 1/G of the
    query's bytes for the group's backward, one pass over memory beside a kernel quadratic in
    the length; one that differs only in a size-1 dimension's stride is restrided as a view.
    The values are unchanged.
    """

    @staticmethod
    def forward(ctx, out):
        # Under ring attention the output is a DTensor: the kernels see its local tensor.
        ctx.dtensor = DTensorLayout(out) if is_dtensor(out) else None
        local = local_tensor(out)
        ctx.layout = (local.shape, local.stride())
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if ctx.dtensor is None:
            return _in_layout(grad, *ctx.layout)
        return ctx.dtensor.wrap(_in_layout(local_tensor(grad), *ctx.layout))


def _in_layout(grad: torch.Tensor, shape, stride) -> torch.Tensor:
    """``grad`` with the strides ``stride`` (a view where the addresses agree, else a copy)."""
    if grad.stride() == stride:
        return grad
    if _strides(shape, grad.stride()) == _strides(shape, stride):
        # Only a size-1 dimension's stride differs: the same addresses, restrided as a view.
        return grad.as_strided(shape, stride)
    return torch.empty_strided(shape, stride, dtype=grad.dtype, device=grad.device).copy_(grad)


def kv_head_groups(groups: int, kv_heads: int) -> int:
    """Groups attention really runs in when ``groups`` are asked for over ``kv_heads``
    key/value heads: the largest divisor of the key/value heads not above ``groups`` (each
    group then holds ``kv_heads // g`` key/value heads and as many times more query heads).
    The planner counts the workspace this way.

    Example:
        >>> kv_head_groups(6, 8), kv_head_groups(32, 8), kv_head_groups(1, 8)
        (4, 8, 1)
    """
    wanted = max(1, min(groups, kv_heads))
    return max(g for g in range(1, wanted + 1) if kv_heads % g == 0)


def _strides(shape, stride) -> tuple[int, ...]:
    """The strides that address memory (a dimension of size 1 has none)."""
    return tuple(st for n, st in zip(shape, stride) if n > 1)


def grouped_attention(
    groups: int,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale=None,
    enable_gqa: bool = False,
):
    """``F.scaled_dot_product_attention`` over ``groups`` groups of key/value heads, or None
    where it cannot be split (dropout, fewer than 4 dimensions, one group).

    Args:
        groups: groups wanted (the largest divisor of the key/value heads not above it is used).
        query, key, value, ...: as for ``F.scaled_dot_product_attention``.

    Returns:
        ``[B, H, S, D]`` in ``[B, S, H, D]`` memory, or None.
    """
    if dropout_p or query.dim() != 4 or key.dim() != 4:
        return None
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv and not (enable_gqa and hq % hkv == 0):
        return None
    g = kv_head_groups(groups, hkv)
    if g <= 1:
        return None
    per_q, per_kv = hq // g, hkv // g
    mask = None
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] != 1:
        if attn_mask.dim() != 4 or attn_mask.shape[1] != hq:
            return None  # a per-head mask laid out otherwise: leave it to SDPA
        mask = attn_mask.split(per_q, dim=1)
    # split(): one backward node that joins the groups' gradients once, not a full-size
    # zero-filled gradient per group.
    qs, ks, vs = query.split(per_q, dim=1), key.split(per_kv, dim=1), value.split(per_kv, dim=1)
    outs = []
    for i in range(g):
        m = attn_mask if mask is None else mask[i]
        # PyTorch's own function: under ring attention the inputs are DTensors already and
        # the replaced name would wrap them again.
        o = SDPA(
            qs[i], ks[i], vs[i], attn_mask=m, dropout_p=0.0, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
        outs.append(_GradInOutputLayout.apply(o).transpose(1, 2))
    return torch.cat(outs, dim=2).transpose(1, 2)


class _Grouping(TorchFunctionMode):
    """Within it, ``F.scaled_dot_product_attention`` runs over head groups."""

    def __init__(self, handle: "AttentionHeadGroups") -> None:
        super().__init__()
        self.handle = handle

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_sdpa(func):
            out = grouped_attention(self.handle.groups, *args, **kwargs)
            if out is not None:
                self.handle.grouped_calls += 1
                return out
        return func(*args, **kwargs)


class AttentionHeadGroups:
    """What :func:`apply_attention_head_groups` attached; ``remove()`` restores the modules.

    Attributes:
        modules: ``(qualified name, attention module)`` pairs wrapped.
        groups: key/value head groups per call.
        grouped_calls: attention calls run over groups so far.
    """

    def __init__(self, modules: list[tuple[str, nn.Module]], groups: int) -> None:
        self.modules, self.groups = modules, groups
        self.grouped_calls = 0
        self._wraps = ForwardWraps(_MARK)

    def _attach(self) -> None:
        self._wraps.wrap_all(
            self.modules,
            lambda _, module: functools.partial(self._call, module.forward),
            "already runs attention over head groups",
        )

    def _call(self, original, *args, **kwargs):
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        with _Grouping(self):
            return original(*args, **kwargs)

    def remove(self) -> None:
        """Restore every module's forward."""
        self._wraps.remove()


def apply_attention_head_groups(model: nn.Module, groups: int) -> AttentionHeadGroups:
    """Run each decoder layer's attention over ``groups`` groups of key/value heads.

    Args:
        model: a Hugging Face model (PEFT wrappers are looked through) whose decoder layers
            have an attention module (``self_attn``, ``attn`` or ``attention``).
        groups: groups per call (>= 2; the largest divisor of the key/value heads not above it).

    Returns:
        An :class:`AttentionHeadGroups`; ``handle.remove()`` restores the modules.

    Example:
        >>> handle = apply_attention_head_groups(model, 8)
        >>> model(input_ids=ids, labels=ids).loss.backward()
        >>> handle.remove()
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 2:
        raise ValueError(f"groups={groups!r} must be an integer >= 2 (1 runs attention whole: do not apply)")
    modules = attention_modules(model)
    handle = AttentionHeadGroups(modules, groups)
    handle._attach()
    return handle
