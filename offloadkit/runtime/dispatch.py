"""PyTorch's dispatch-mode base and pytree helper (private modules, kept here): the
allocation tracker in :mod:`offloadkit.testing` watches every op's outputs through them."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TorchDispatchMode", "tree_leaves"]
