"""Weak references to untyped storages (a private PyTorch API, kept here).

A weak reference to a storage keeps its ``StorageImpl`` address from being reused while
it is held, so the address can key a dictionary, and says whether the storage is gone.
PyTorch's own ``StorageWeakRef`` raises from ``__del__`` when it was only half built (a
``KeyboardInterrupt`` landing inside its constructor prints a traceback at exit); this
one tolerates that.
"""

from __future__ import annotations

import torch

__all__ = ["StorageRef"]

_free_weak_ref = torch.UntypedStorage._free_weak_ref
_expired = torch.UntypedStorage._expired


class StorageRef:
    """A weak reference to ``storage``.

    Example:
        >>> ref = StorageRef(torch.zeros(2).untyped_storage())
        >>> ref.expired()
        True
    """

    __slots__ = ("cdata",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.cdata = storage._weak_ref()

    def expired(self) -> bool:
        return bool(_expired(self.cdata))

    def __del__(self) -> None:
        cdata = getattr(self, "cdata", None)
        if cdata is not None:
            self.cdata = None
            _free_weak_ref(cdata)
