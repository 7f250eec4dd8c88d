"""Storage identity and tensor metadata that PyTorch exposes only through private names,
kept here: weak references to untyped storages, the key of a storage, a tensor's version
counter, a view's base and a DTensor's local shard.

A weak reference to a storage keeps its ``StorageImpl`` address from being reused while
it is held, so the address can key a dictionary, and says whether the storage is gone.
PyTorch's own ``StorageWeakRef`` raises from ``__del__`` when it was only half built (a
``KeyboardInterrupt`` landing inside its constructor prints a traceback at exit); this
one tolerates that.
"""

from __future__ import annotations

import torch

__all__ = ["StorageRef", "base_of", "local_shard", "storage_key", "version_of"]

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


def storage_key(storage: torch.UntypedStorage) -> int:
    """The address of ``storage``'s StorageImpl: equal for every tensor sharing the storage
    (stable while the storage, or a :class:`StorageRef` to it, is alive)."""
    return storage._cdata


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter (shared by views; bumped by every in-place write)."""
    return t._version


def base_of(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or None."""
    return t._base


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2, tensor parallel); any other tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t
