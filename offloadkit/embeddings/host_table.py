"""A frozen input embedding table kept in pinned host memory and read by the GPU in place.

The table's parameter keeps its shape, dtype and device: its data becomes a CUDA tensor over
the pinned host copy (:func:`~offloadkit.runtime.device.device_alias_of_host`), so the
embedding kernel gathers the rows a batch looks up across the bus, and everything that
inspects or moves the model (``model.device``, ``model.to("cuda")``, ``state_dict()``,
saving) sees the same values where it did. The table's GPU memory goes back to the caching
allocator. :meth:`HostEmbeddings.remove` copies the table back into GPU memory.
"""

from __future__ import annotations

import torch
from torch import nn

from offloadkit.models.heads import find_output_head, unwrap_model
from offloadkit.runtime.device import device_alias_of_host

__all__ = ["HostEmbeddings", "offload_embeddings", "refusal"]


class HostEmbeddings:
    """What :func:`offload_embeddings` attached; ``remove()`` puts the table back on the GPU.

    Attributes:
        module: the embedding module.
        table_host: the pinned host copy the GPU reads.
        nbytes: bytes the GPU no longer holds.
    """

    def __init__(self, module: nn.Embedding, table_host: torch.Tensor) -> None:
        self.module = module
        self.table_host = table_host
        self.nbytes = table_host.numel() * table_host.element_size()

    def remove(self) -> None:
        weight = self.module.weight
        if weight.data.data_ptr() == self.table_host.data_ptr():
            # A fresh GPU copy of whatever the table holds now (a copy in device memory).
            weight.data = weight.data.clone(memory_format=torch.contiguous_format)
        self.table_host = torch.empty(0)


def refusal(model: nn.Module) -> str | None:
    """Why ``model``'s input embedding table cannot stay in host memory, or None."""
    base = unwrap_model(model)
    return _refusal(base, getattr(base, "get_input_embeddings", lambda: None)())


def _refusal(model: nn.Module, module: nn.Module | None) -> str | None:
    if not isinstance(module, nn.Embedding):
        return f"the model's input embeddings are {type(module).__name__}, not an nn.Embedding table"
    weight = module.weight
    if weight.requires_grad:
        return "the input embedding table trains (it needs its gradient and update on the GPU)"
    head = find_output_head(model)
    if head is not None and getattr(head, "weight", None) is weight:
        return "the output head shares the input embedding table (tied embeddings) and multiplies it every step"
    if type(weight.data) is not torch.Tensor:
        return f"the table is a {type(weight.data).__name__} (sharded or quantized), not a plain tensor"
    if weight.device.type != "cuda":
        return f"the table is on {weight.device}, not on a GPU"
    return None


def offload_embeddings(model: nn.Module) -> HostEmbeddings:
    """Keep ``model``'s frozen input embedding table in pinned host memory, read in place.

    Raises:
        ValueError: the table trains, is tied to the output head, is not a plain tensor on a
            GPU, or this GPU cannot read host memory in place.

    Example:
        >>> handle = offload_embeddings(model)   # a LoRA model on a GPU   # doctest: +SKIP
        >>> handle.nbytes >> 20                  # MiB off the GPU          # doctest: +SKIP
        1002
    """
    base = unwrap_model(model)
    module = getattr(base, "get_input_embeddings", lambda: None)()
    reason = _refusal(base, module)
    if reason is not None:
        raise ValueError(reason)
    weight = module.weight
    table_host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)
    table_host.copy_(weight.detach())
    table_gpu = device_alias_of_host(table_host, weight.device, owner=table_host)
    if table_gpu is None:
        raise ValueError("this GPU cannot read pinned host memory in place (no unified addressing)")
    weight.data = table_gpu  # the device copy's memory goes back to the caching allocator
    return HostEmbeddings(module, table_host)
