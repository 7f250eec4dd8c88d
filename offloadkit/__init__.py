"""offloadkit: train and fine-tune models that do not fit in GPU memory.

Quick start::

    from offloadkit import get_act_offloading_ctx_manager

    ctx = get_act_offloading_ctx_manager(model)
    for batch in loader:
        with ctx:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
"""

from offloadkit.api import (
    get_act_offloading_ctx_manager,
    get_lora_act_offloading_ctx_manager,
)
from offloadkit.engine import (
    NoOpManager,
    OffloadActivations,
    OffloadPolicy,
    OffloadStats,
)
from offloadkit.kernels import apply_liger_kernels
from offloadkit.longctx import apply_attention_head_groups, apply_chunked_loss, apply_tiled_mlp, chunked_cross_entropy
from offloadkit.lora import apply_fused_lora
from offloadkit.runtime.device import use_expandable_segments
from offloadkit.storage import HostBufferPool, HostMemoryBudget, HostTier

__version__ = "0.2.0"

__all__ = [
    "HostBufferPool",
    "HostMemoryBudget",
    "HostTier",
    "NoOpManager",
    "OffloadActivations",
    "OffloadPolicy",
    "OffloadStats",
    "apply_chunked_loss",
    "apply_tiled_mlp",
    "apply_attention_head_groups",
    "apply_fused_lora",
    "apply_liger_kernels",
    "chunked_cross_entropy",
    "get_act_offloading_ctx_manager",
    "get_lora_act_offloading_ctx_manager",
    "use_expandable_segments",
]
