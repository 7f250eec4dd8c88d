"""Which tensors a region allocates and saves for backward, observed on any device."""

from __future__ import annotations

import torch

from offloadkit.runtime.dispatch import TorchDispatchMode, tree_leaves

__all__ = ["AllocationTracker", "SavedTensorTracker"]


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
