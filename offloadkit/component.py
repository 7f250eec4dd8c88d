"""The record of one feature :func:`~offloadkit.prepare` attaches: its name, its options, why it
comes where it does in the apply order, how it is built, reported and detached, and what it
costs (:class:`Footprint`).

Each feature states its record beside its code (``longctx/component.py``,
``checkpointing/component.py``, ...); :mod:`offloadkit.components` lists them in apply order.
(This module holds only the record, so that a feature's ``component.py`` can import it while the
registry imports that ``component.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from torch import nn

from offloadkit.options import Options

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = [
    "Component",
    "Footprint",
    "FootprintOptions",
    "FootprintParallelism",
    "FootprintShape",
    "FootprintWorkload",
    "OptionSet",
]


OptionsT = TypeVar("OptionsT", bound=Options)


def _remove(handle: Any) -> None:
    handle.remove()


class FootprintShape(Protocol):
    """The model's dimensions a footprint reads (the planner's ``ModelShape`` has them)."""

    @property
    def hidden(self) -> int: ...
    @property
    def intermediate(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def linears(self) -> list[tuple[int, int]]: ...
    @property
    def params(self) -> int: ...
    @property
    def layer_params(self) -> int: ...
    @property
    def embed_params(self) -> int: ...
    @property
    def head_params(self) -> int: ...
    @property
    def tied(self) -> bool: ...
    def lora_params(self, rank: int) -> int: ...


class FootprintParallelism(Protocol):
    """The ranks of a run, as a footprint reads them (the planner's ``Parallelism``)."""

    @property
    def rotation(self) -> str: ...
    @property
    def sequence_ranks(self) -> int: ...
    @property
    def splits_sequence(self) -> bool: ...
    @property
    def weight_shards(self) -> int: ...
    @property
    def ddp(self) -> bool: ...
    @property
    def bucket_view(self) -> bool: ...


class FootprintWorkload(Protocol):
    """What is trained, as a footprint reads it (the planner's ``Workload`` has it: the
    runtime states its costs without importing the planner)."""

    @property
    def shape(self) -> FootprintShape: ...
    @property
    def tokens(self) -> int: ...
    @property
    def dtype_bytes(self) -> int: ...
    @property
    def adapter_bytes(self) -> int: ...
    @property
    def lora_rank(self) -> int: ...
    @property
    def block_input_bytes(self) -> int: ...
    @property
    def optimizer_precision(self) -> str: ...
    @property
    def optimizer_state_bytes(self) -> int: ...
    @property
    def copy_window_bytes(self) -> int | None: ...
    @property
    def updates_in_backward(self) -> bool: ...
    @property
    def parallel(self) -> FootprintParallelism: ...


class FootprintOptions(Protocol):
    """The options a footprint reads: each component's, as the run (or a plan) sets them
    (:meth:`of`). Nothing else: what a step spends follows from the components' options and
    the workload alone (:class:`OptionSet` is the plain one)."""

    def of(self, cls: type[OptionsT]) -> OptionsT:
        """``cls``'s options as set (counts the planner chose resolved, never automatic), or
        their defaults."""
        ...


@dataclass(frozen=True)
class OptionSet:
    """Components' options, one per class, as a footprint reads them (:class:`FootprintOptions`).

    Example:
        >>> from offloadkit.layers.options import StreamingOptions
        >>> OptionSet((StreamingOptions(enabled=True),)).of(StreamingOptions).enabled
        True
    """

    options: tuple[Options, ...] = ()

    def of(self, cls: type[OptionsT]) -> OptionsT:
        """``cls``'s options among these, else its defaults."""
        for o in self.options:
            if isinstance(o, cls):
                return o
        return cls()


@dataclass(frozen=True)
class Footprint:
    """What one feature spends in one training step, in the terms the planner counts
    (``planning/memory.py``: a fixed part held all step, plus the larger of the loss phase
    and one layer's recompute and backward; host RAM and disk beside; ``planning/timing.py``:
    executed FLOPs). The planner sums the footprints of :data:`offloadkit.components.COMPONENTS`
    in their order with the model's own bytes.

    Attributes:
        gpu: named GPU bytes held all step; a name the model's own parts have (``weights``,
            ``trainable state``) replaces that part (streamed layers hold fewer weights).
        loss: named GPU bytes held during the loss phase.
        layer: named GPU bytes one layer's backward phase holds beside its recompute and
            temporaries (a replayed run's recomputed inputs).
        layer_end: the same parts as they stand at the end of backward, the first decoder
            layer's (a name here replaces that part of ``layer`` there): what arrives only
            then, as the embedding's update.
        per_layer: named GPU bytes each decoder layer holds from its forward until its own
            backward: every layer's through the loss and the first layers' backward, one
            layer's by the end of backward.
        layer_saved: bytes autograd saves inside each decoder layer for this feature's part:
            every layer's, all step, without checkpointing; one layer's, in its recompute,
            with it.
        mlp_backward / attention_backward: what it adds to the temporaries while one layer's
            MLP, and its attention, run backward (the planner holds the larger of the two
            sides, not their sum; an addition may be negative: what it takes off).
        backward_part: the name of a layer-phase part that shows what this feature's
            additions raise the larger side by ("": counted within ``layer backward``).
        backward_flops: FLOPs it adds to the backward pass (recomputed work).
        host: named host RAM bytes (pinned copies, staging buffers).
        disk: bytes written to disk.
    """

    gpu: dict[str, int] = field(default_factory=dict)
    loss: dict[str, int] = field(default_factory=dict)
    layer: dict[str, int] = field(default_factory=dict)
    layer_end: dict[str, int] = field(default_factory=dict)
    per_layer: dict[str, int] = field(default_factory=dict)
    layer_saved: int = 0
    mlp_backward: int = 0
    attention_backward: int = 0
    backward_part: str = ""
    backward_flops: int = 0
    host: dict[str, int] = field(default_factory=dict)
    disk: int = 0


@dataclass(frozen=True)
class Component:
    """One feature of a run, as :func:`~offloadkit.prepare` builds it.

    Attributes:
        name: the key of its handle in ``runtime.handles``.
        options: its options class; ``build`` gets ``config.options(options)``.
        why_here: one line: the reason for its place in the apply order.
        build: ``(model, options, run) -> handle or None``: attach the feature (None when its
            options leave it off, or when it cannot take effect: then it says why with
            ``run.note``). ``run`` is the :class:`~offloadkit.compose.OffloadRuntime` being
            built: its config, scheduler, ``step_timeline()`` and the handles built before.
        report: ``handle -> dict``: the keys this feature adds to ``runtime.report()``.
        remove: ``handle -> None``: detach it (``runtime.close()``, in reverse apply order);
            default ``handle.remove()``.
        footprint: ``(workload, options) -> Footprint``: what it costs in a step as the
            planner counts it, from its own constants and the components' options
            (:class:`FootprintOptions`; None: the planner still counts it itself).
        effective: ``(model, options) -> options``: the options as they will take effect on
            this model (what its build would refuse, turned off), for the planner to count
            (None: as set).
    """

    name: str
    options: type[Options]
    why_here: str
    build: Callable[[nn.Module, Any, OffloadRuntime], Any]
    report: Callable[[Any], dict] | None = None
    remove: Callable[[Any], None] = _remove
    footprint: Callable[[FootprintWorkload, FootprintOptions], Footprint] | None = None
    effective: Callable[[nn.Module, Any], Any] | None = None
