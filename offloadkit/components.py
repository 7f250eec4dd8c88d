"""The features :func:`~offloadkit.prepare` attaches, in the order it attaches them.

Each feature states its :class:`~offloadkit.component.Component` record beside its code: its
options, why it comes where it does, how it is built from them (and from the handles built
before it), reported and detached. ``prepare()`` builds them in this order; ``close()``
detaches them in the reverse order. A new feature is its folder's ``component.py`` and one
line here.

``python -m offloadkit.config_docs --write-docs docs/config.md`` writes the table of config keys
(each key's component, default and documentation, read from the options classes' docstrings)
and this apply order.
"""

from __future__ import annotations

from offloadkit.checkpointing.component import CHECKPOINTING
from offloadkit.component import Component
from offloadkit.embeddings.component import EMBEDDINGS
from offloadkit.engine.component import ACTIVATIONS
from offloadkit.kernels.component import ATTENTION_KERNEL, KERNELS
from offloadkit.layers.component import LAYER_STREAMING
from offloadkit.longctx.component import CHUNKED_LOSS, HEAD_GROUPS, TILED_MLP
from offloadkit.lora.component import FUSED_LORA
from offloadkit.parallel.component import CONTEXT_PARALLEL
from offloadkit.storage.component import HOST_BUDGET

__all__ = ["COMPONENTS", "Component"]

COMPONENTS: tuple[Component, ...] = (
    CONTEXT_PARALLEL,
    CHUNKED_LOSS,
    FUSED_LORA,
    KERNELS,
    ATTENTION_KERNEL,
    TILED_MLP,
    HEAD_GROUPS,
    CHECKPOINTING,
    HOST_BUDGET,
    ACTIVATIONS,
    LAYER_STREAMING,
    EMBEDDINGS,
)
