"""The policy's settings and the parameter storages it tracks: what the rules of
:mod:`offloadkit.engine.decide` read about a model.

Parameters are recognised by storage, not only by type: a matmul saves ``weight.t()`` (a
view), FSDP2 saves views of all-gathered unsharded parameters, and ``.data``/``.detach()``
aliases carry no Parameter type at all.
"""

from __future__ import annotations

import torch
from torch import nn

from offloadkit.defaults import MIN_OFFLOAD_SIZE
from offloadkit.engine.decide import KEEP_REASONS, tensor_rule
from offloadkit.runtime.storages import StorageRef, base_of, local_shard, storage_key

__all__ = ["OffloadPolicy", "KEEP_REASONS"]


def _storage(t: torch.Tensor):
    try:
        return local_shard(t).untyped_storage()
    except Exception:  # meta / functional / exotic subclasses have no real storage
        return None


class OffloadPolicy:
    """Decides, per saved tensor, whether it may be offloaded.

    Args:
        min_offload_size: smallest tensor (bytes) worth moving.
        device_types: device types whose tensors are offloaded (``("cuda",)`` by default;
            add ``"cpu"`` to move CPU activations, e.g. to disk or for CPU-only tests).

    Example:
        >>> policy = OffloadPolicy(min_offload_size=1024, device_types=("cpu",))
        >>> lin = torch.nn.Linear(64, 64)
        >>> policy.track(lin)
        >>> policy.keep_reason(lin.weight.t()), policy.keep_reason(torch.empty(4096))
        ('parameter', None)
    """

    def __init__(self, min_offload_size: int = MIN_OFFLOAD_SIZE, device_types: tuple[str, ...] = ("cuda",)) -> None:
        if not isinstance(min_offload_size, int) or isinstance(min_offload_size, bool) or min_offload_size < 0:
            raise ValueError(f"min_offload_size={min_offload_size!r} is invalid; pass a byte count >= 0 (default 1024)")
        self.min_offload_size = min_offload_size
        self.device_types = tuple(device_types)
        self._modules: list[nn.Module] = []
        # StorageImpl address -> weak reference. Holding the weak reference keeps the address
        # from being reused by a new (activation) storage after the parameter's is freed.
        self._param_storages: dict[int, StorageRef] = {}

    def track(self, module: nn.Module) -> None:
        """Treat every parameter and buffer storage of ``module`` as never-offload."""
        if not isinstance(module, nn.Module):
            raise ValueError(f"track() needs an nn.Module, got {type(module).__name__}")
        if all(m is not module for m in self._modules):
            self._modules.append(module)
        self.refresh()

    def untrack_all(self) -> None:
        self._modules.clear()
        self._param_storages = {}

    def refresh(self) -> None:
        """Re-read parameter storages (they change when FSDP2 reshards or weights stream)."""
        found = {}
        for module in self._modules:
            for t in (*module.parameters(), *module.buffers()):
                # A streamed frozen weight also owns a flat device storage it may not point at now.
                for storage in (_storage(t), t.__dict__.get("_offloadkit_streamed_storage")):
                    if storage is not None:
                        found[storage_key(storage)] = StorageRef(storage)
        self._param_storages = found

    def storage_pointers(self) -> set[int]:
        """Data pointers of the tracked parameter/buffer storages."""
        out = set()
        for module in self._modules:
            for t in (*module.parameters(), *module.buffers()):
                storage = _storage(t)
                if storage is not None:
                    out.add(storage.data_ptr())
        return out

    def is_parameter_storage(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(base_of(t), nn.Parameter):
            return True
        if not self._param_storages:
            return False
        storage = _storage(t)
        ref = self._param_storages.get(storage_key(storage)) if storage is not None else None
        return ref is not None and not ref.expired()

    def keep_reason(self, t: torch.Tensor) -> str | None:
        """Why ``t`` stays where it is by the rules that read the tensor alone (see
        :func:`offloadkit.engine.decide.tensor_rule`), or None if it may be offloaded."""
        return tensor_rule(t, self.device_types, self.min_offload_size, self.is_parameter_storage)
