"""Which tensors a region allocates and saves for backward, observed on any device."""

from __future__ import annotations

import torch

from offloadkit.runtime.dispatch import TorchDispatchMode, tree_leaves

__all__ = ["AllocationTracker", "SavedTensorTracker", "saved_bytes_in_layer"]


class AllocationTracker(TorchDispatchMode):
    """Record the storages that ops in the region allocate (forward and, for CPU tensors,
    backward, which runs on the calling thread).

    Outputs that share storage with an input (views, in-place and ``out=`` results) are not
    allocations and are skipped; an expanded scalar counts as one element.

    Example:
        >>> with AllocationTracker() as t:
        ...     loss = f(x); loss.backward()
        >>> t.max_elements, t.shapes_over(10**6)
    """

    def __init__(self) -> None:
        super().__init__()
        self.max_elements = 0
        self.records: list[tuple[str, tuple, int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.element_size() > 0 and t.untyped_storage().data_ptr() not in inputs:
                elements = t.untyped_storage().nbytes() // t.element_size()
                self.max_elements = max(self.max_elements, elements)
                self.records.append((str(func), tuple(t.shape), elements, t.dtype))
        return out

    def shapes_over(self, elements: int, dtype: torch.dtype | None = None) -> list[tuple[str, tuple]]:
        """(op, shape) of every allocation of at least ``elements`` elements (of ``dtype``)."""
        return [(op, shape) for op, shape, n, dt in self.records if n >= elements and (dtype is None or dt == dtype)]


class SavedTensorTracker(torch.autograd.graph.saved_tensors_hooks):
    """Record the shapes of the tensors autograd saves for backward in the region."""

    def __init__(self) -> None:
        self.shapes: list[tuple] = []
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> "SavedTensorTracker":
        super().__enter__()
        return self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(t.shape))
        return t

    @property
    def max_elements(self) -> int:
        return max((int(torch.Size(s).numel()) for s in self.shapes), default=0)


def saved_bytes_in_layer(model, batch: dict, index: int) -> int:
    """Bytes of the distinct storages autograd saves inside decoder layer ``index`` of ``model``
    over one forward and backward of ``batch``, less parameters and storages the next layer
    saves too (the rotary tables)."""
    layers = [m for n, m in model.named_modules() if n.endswith(("layers.%d" % index, "layers.%d" % (index + 1)))]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: list[dict[int, int]] = [{}, {}]
    own = [layer.__dict__.get("forward") for layer in layers]  # a wrapper already attached, if any
    for k, layer in enumerate(layers):
        original = layer.forward

        def forward(*a, _o=original, _k=k, **kw):
            def pack(t):
                seen[_k][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return _o(*a, **kw)

        layer.forward = forward
    try:
        model(**batch).loss.backward()
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward
    return sum(n for ptr, n in seen[0].items() if ptr not in params and ptr not in seen[1])
