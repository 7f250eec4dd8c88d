"""Layer streaming: decoder-layer weights live in pinned host memory and visit the GPU one
layer at a time, prefetched ahead in forward and in reverse order in backward.

Frozen weights (the base of LoRA/QLoRA models) are streamed by default. With
``trainable=True`` the trainable ones are too (a full fine-tune): an optimizer that updates
each parameter during backward (:class:`~offloadkit.optim.BackwardAdamW`) finds the block
resident while its gradients are formed, and the updated bytes go back to the host copy when
the block is evicted (:class:`~offloadkit.layers.flat.FlatWeights`). An optimizer stepping
after backward (clipping, accumulation, ``torch.optim.AdamW``) reads and writes the evicted
weights in place in host memory through the GPU's mapping of it: correct, at the bus's speed,
with every gradient held on the GPU until then.

Triggers:

* forward: the model's forward pre-hook prefetches the first layers; block ``i``'s
  pre-hook makes ``i`` resident and prefetches up to ``i + depth - 1``; its post-hook
  evicts ``i``.
* backward: a pre-hook on the grad_fn of block ``i``'s output fires before any of the
  block's backward work, including a checkpoint's recompute: evict the blocks after ``i``
  (their backward is done), make ``i`` resident, prefetch ``i - 1``... So a block's
  recompute and its backward share one load, and hooks that run again during recompute
  only confirm residency; they never prefetch in the forward direction.
* the head's backward pre-hook prefetches the last blocks; the end of backward evicts all
  (and the next forward evicts whatever a failed backward left resident).

At most ``depth`` blocks of weights are resident at any time, or the length of a replayed
run of blocks (dropped block inputs recomputed in backward: :meth:`LayerStreamer.make_resident`). Outside forward and
backward the weights are read from (and written to) their host copies; PEFT's
``merge``/``unmerge`` of adapters inside a streamed block run with that block resident
and write the merged weights back to the host copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Callable

import torch
from torch import nn

from offloadkit.defaults import STREAM_DEPTH
from offloadkit.engine.stats import OffloadStats, WaitClock
from offloadkit.layers.flat import FlatWeights, order_after_write_back, streamable_reason
from offloadkit.layers.stats import StreamStats
from offloadkit.layers.weight_files import WeightFiles
from offloadkit.models.heads import find_output_head, unwrap_model
from offloadkit.parallel.compat import fsdp2_sharded, streaming_refusal
from offloadkit.runtime.autograd import current_graph_task, in_backward
from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.storage.pool import HostBufferPool
from offloadkit.transfer.completion import order_after
from offloadkit.transfer.prefetch import Ahead, PrefetchScheduler, Status
from offloadkit.transfer.timeline import StepTimeline, TimelineListener

__all__ = ["LayerStreamer"]


class LayerStreamer:
    """Streams the weights of a model's blocks from pinned host memory.

    Use :func:`apply_layer_streaming` to build one. ``remove()`` puts every weight back on
    the GPU for good and detaches all hooks.
    """

    def __init__(
        self,
        model: nn.Module,
        blocks,
        *,
        depth: int = STREAM_DEPTH,
        use_pin_memory: bool = True,
        budget: HostMemoryBudget | None = None,
        head: nn.Module | None = None,
        measure_waits: bool = True,
        device: torch.device | str | None = None,
        trainable: bool = False,
        scheduler: PrefetchScheduler | None = None,
        disk_dir: str | None = None,
        timeline: StepTimeline | None = None,
    ) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth={depth!r} is invalid; it is the number of resident layers, an int >= 1")
        self.model = model
        self.depth = depth
        self.trainable = trainable
        self.device = _streaming_device(device)
        cuda = self.device.type == "cuda"
        self.budget = budget if budget is not None else HostMemoryBudget()
        # Sized once, one block per layer: exact chunks, no growth slack.
        self.pool = HostBufferPool(use_pin_memory and cuda, self.budget, grow_in_chunks=False)
        # Past the RAM budget, blocks' host copies go to files (read through pinned staging).
        self.files = WeightFiles(disk_dir, self.budget, use_pin_memory) if disk_dir is not None else None
        self.stats = StreamStats()
        self._clock = WaitClock(measure_waits and cuda)
        self._clock_stats = OffloadStats()
        self._lock = threading.RLock()
        self._handles: list = []
        if scheduler is not None and not isinstance(scheduler, PrefetchScheduler):
            raise ValueError(f"scheduler={scheduler!r} is invalid; pass a transfer.PrefetchScheduler or None")
        self.scheduler = scheduler if scheduler is not None else PrefetchScheduler()
        self._ahead: set[int] = set()  # id() of the blocks fetched ahead, not yet used
        self._tasks: set[int] = set()  # backward passes (graph tasks) this streamer acted in
        self._owner_checked = False  # the first forward found no FSDP2 sharding of the model

        owners = Counter(id(p) for _, p in unwrap_model(model).named_parameters(remove_duplicate=False))
        self.layers: list[FlatWeights] = []
        self.block_names: list[str] = []
        self._index_of: dict[int, int] = {}  # id(block) -> its index in self.layers
        for name, block in blocks:
            params = []
            for mod_name, module in block.named_modules():
                for attr, p in list(module.named_parameters(recurse=False)):
                    reason = streamable_reason(p, shared=owners[id(p)] > 1, trainable=trainable)
                    if reason is None and p.device.type != self.device.type:
                        reason = "not on the compute device"
                    if reason is None:
                        params.append((f"{mod_name}.{attr}" if mod_name else attr, p))
                    else:
                        self.stats.skipped_params[reason] += 1
            if params:
                self.layers.append(FlatWeights(name, params, self.pool, self.device, self.files))
                self.block_names.append(name)
                self._index_of[id(block)] = len(self.layers) - 1
                self._hook_block(len(self.layers) - 1, block)
        if self.files is not None and not self.files.blocks:
            self.files.close()  # everything fitted in RAM
            self.files = None
        self.stats.disk_layers = sum(layer.on_disk for layer in self.layers)
        self.stats.disk_bytes = sum(layer.nbytes for layer in self.layers if layer.on_disk)
        if not self.layers:
            what = "parameters it can stream" if trainable else "frozen parameters"
            hint = "" if trainable else "; freeze the base model (e.g. use LoRA) or stream trainable weights too"
            raise ValueError(f"layer streaming found no {what} in the blocks ({dict(self.stats.skipped_params)}){hint}")
        # Blocks count as resident from the one in use: depth 2 keeps one more on its way.
        self._lane = self.scheduler.lane("weights", self._fetch_ahead, Ahead(groups=depth))
        for layer in self.layers:
            self._evict(layer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # return the blocks of the original weights
        # The step's points (forward start, the blocks, the head, the end of backward) come
        # from one timeline, shared with the run's other clients when given.
        if timeline is None:
            timeline = StepTimeline(model, head=head if head is not None else find_output_head(model))
            self._handles.append(timeline)
        else:
            # A timeline made without the model or the head (a bare engine's) gets them.
            timeline.attach(model, head if head is not None or timeline.head is not None else find_output_head(model))
        self.timeline = timeline
        self._handles.append(timeline.watch_blocks(block for _, block in blocks if id(block) in self._index_of))
        self._handles.append(timeline.subscribe(_Events(self)))

    # -- the step's points ------------------------------------------------------------------
    def _block_start(self, block: nn.Module) -> None:
        index = self._index_of.get(id(block))
        if index is None:
            return  # a block of another client
        with self._lock:
            self._ensure(index)  # in backward: a recompute, its backward trigger already loaded it
            if not in_backward():
                self._look_ahead(range(index, len(self.layers)))

    def _block_end(self, block: nn.Module, output) -> Callable[[], None] | None:
        index = self._index_of.get(id(block))
        if index is None or in_backward():
            return None  # a recompute: the block's backward still needs the weights
        with self._lock:
            self._evict(self.layers[index])
        return lambda: self._backward_reached(index)

    # -- hooks ---------------------------------------------------------------------------
    def _hook_block(self, index: int, block: nn.Module) -> None:
        # Reading or loading the weights where they rest waits for write-backs a failed
        # backward left in flight (a finished one ordered them already).
        self._handles.append(block.register_state_dict_pre_hook(lambda *_: self._order_after_write_backs()))
        self._handles.append(block.register_load_state_dict_pre_hook(lambda *_: self._order_after_write_backs()))
        if self.trainable:
            for slot in self.layers[index].slots:
                if slot.param.requires_grad:
                    # A gradient that completes after its block left (a weight also used outside
                    # the block) is followed by an update of the host copy: order it after the
                    # block's write-back. Optimizers created later hook in after this one.
                    self._handles.append(slot.param.register_post_accumulate_grad_hook(order_after_write_back))
        # Loading into a resident block writes the device bytes: keep the host copy in step.
        self._handles.append(
            block.register_load_state_dict_post_hook(lambda module, keys: self.layers[index].write_back())
        )
        for module in block.modules():
            for method in ("merge", "unmerge"):
                if callable(getattr(module, method, None)) and hasattr(module, "get_base_layer"):
                    self._wrap_method(index, module, method)

    def _wrap_method(self, index: int, module: nn.Module, method: str) -> None:
        original = getattr(module, method)

        def resident_call(*args, **kwargs):
            with self.resident(index):
                return original(*args, **kwargs)

        module.__dict__[method] = resident_call
        self._handles.append(_AttrHandle(module, method, resident_call))

    @contextlib.contextmanager
    def resident(self, index: int):
        """Keep block ``index`` resident for the ``with`` body (e.g. to edit its weights on the
        GPU); changes are written back to the host copy afterwards.

        Example:
            >>> with streamer.resident(0):
            ...     model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
        """
        with self._lock:
            layer = self.layers[index]
            was_resident = layer.resident
            self._ensure(index)
        try:
            yield layer
        finally:
            with self._lock:
                layer.adopt_replaced()
                if layer.device.type == "cuda":
                    torch.cuda.current_stream(layer.device).synchronize()
                layer.write_back()
                if not was_resident:
                    self._evict(layer)

    def _forward_start(self) -> None:
        if in_backward():
            return
        if not self._owner_checked:
            # fully_shard after the streamer was attached: FSDP2 replaced the weights it
            # streams (with shards of its own), so streaming would save nothing.
            where = fsdp2_sharded(self.model)
            if where is not None:
                raise ValueError(streaming_refusal(where, " (attached before fully_shard)"))
            self._owner_checked = True
        with self._lock:
            first = range(min(self.depth, len(self.layers)))
            for j, layer in enumerate(self.layers):
                layer.check_params()
                if layer.resident and j not in first:
                    self._evict(layer)  # left resident by a backward that failed before its end
            self._order_after_write_backs()
            self._look_ahead(range(len(self.layers)))

    def _backward_start(self) -> None:
        with self._lock:
            self._join_backward()
            self._look_ahead(range(len(self.layers) - 1, -1, -1))

    def _backward_reached(self, index: int) -> None:
        with self._lock:
            self._join_backward()
            for j, layer in enumerate(self.layers):
                if j > index and layer.resident:
                    self._evict(layer)  # their backward is finished
            self._ensure(index)
            self._look_ahead(range(index, -1, -1))

    def make_resident(self, block: nn.Module) -> None:
        """Make ``block``'s weights resident now, for a call the block hooks do not see (a
        checkpoint region replaying dropped block inputs in backward runs the blocks before
        the one backward has reached). It stays resident until backward passes it."""
        index = self._index_of.get(id(block))
        if index is None:
            return  # nothing of this block is streamed
        with self._lock:
            self._join_backward()  # the end of this backward evicts it
            if not self.layers[index].resident:
                self.stats.replay_loads += 1
                self._load(self.layers[index])
            self._ensure(index)

    def _join_backward(self) -> None:
        """The backward pass running now evicts every block when it ends: only a pass this
        streamer acted in (a nested one elsewhere, e.g. autograd.grad inside a block's
        backward, must not evict blocks the outer pass still uses)."""
        task = current_graph_task()
        if task is not None and task not in self._tasks:
            self._tasks.add(task)
            self.timeline.ensure_backward_end()

    def _backward_ended(self, task: int) -> None:
        if task in self._tasks:
            self._tasks.discard(task)
            self._end_backward()

    def _end_backward(self) -> None:
        with self._lock:
            for layer in self.layers:
                self._evict(layer)
            self._order_after_write_backs()
            self._clock.collect(self._clock_stats)
            self.stats.wait_seconds = self._clock_stats.wait_seconds

    def _evict(self, layer: FlatWeights) -> None:
        self._settle(layer)  # fetched ahead and never used
        if layer.evict():
            self.stats.write_backs += 1

    def _order_after_write_backs(self) -> None:
        """Work queued from now on (a deferred optimizer step, reading or saving the weights)
        sees the host copies with every update of this backward written back."""
        compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for layer in self.layers:
            if layer.written is not None and compute is not None:
                order_after(compute, layer.written)  # a file's write: the host waits for it first
            layer.written = None

    # -- residency -----------------------------------------------------------------------
    def _look_ahead(self, order: range) -> None:
        """Keep ``depth`` blocks resident or on their way, walking ``order`` (need order from the
        block in use)."""
        layers = self.layers
        upcoming = ((j, layers[j].nbytes, j, Status.HERE if layers[j].resident else Status.FETCH) for j in order)
        self.scheduler.prefetch(self._lane, upcoming)

    def _fetch_ahead(self, index) -> None:
        layer = self.layers[index]
        self._load(layer)
        self._ahead.add(id(layer))
        self.stats.prefetched += 1

    def _settle(self, layer: FlatWeights) -> None:
        if id(layer) in self._ahead:
            self._ahead.discard(id(layer))
            self._lane.settle(layer.nbytes)

    def _ensure(self, index: int) -> None:
        layer = self.layers[index]
        self._settle(layer)  # in use: it leaves the look-ahead window
        if not layer.resident:
            self._load(layer)
            self.stats.misses += 1
        consumer = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if not layer.consumed and layer.ready is not None and consumer is not None:
            self._clock.wait(consumer, layer.ready, "backward" if in_backward() else "forward", self._clock_stats)
        layer.consume(consumer)

    def _load(self, layer: FlatWeights) -> None:
        layer.load()
        self.stats.loads += 1
        self.stats.loaded_bytes += layer.nbytes
        self.stats.max_resident = max(self.stats.max_resident, sum(lay.resident for lay in self.layers))

    # -- info / teardown -----------------------------------------------------------------------
    @property
    def streamed_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def resident_layers(self) -> int:
        return sum(layer.resident for layer in self.layers)

    def collect_stats(self) -> StreamStats:
        with self._lock:
            self._clock.collect(self._clock_stats, block=True)
            self.stats.wait_seconds = self._clock_stats.wait_seconds
            if self.files is not None:
                self.stats.disk_read_bytes = self.files.bytes_read
            return self.stats

    def remove(self) -> None:
        """Put every streamed weight back on the device for good and detach all hooks."""
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for layer in self.layers:
                if layer.host is not None:
                    layer.materialize()
            self.pool.close()
            if self.files is not None:
                self.files.close()
                self.files = None
            self._lane.close()


class _Events(TimelineListener):
    """The streamer's part in the step's timeline."""

    def __init__(self, streamer: LayerStreamer) -> None:
        self.streamer = streamer

    def forward_start(self, module, args) -> None:
        self.streamer._forward_start()

    def block_start(self, block) -> None:
        self.streamer._block_start(block)

    def block_end(self, block, output):
        return self.streamer._block_end(block, output)

    def head_end(self, output):
        return self.streamer._backward_start

    def backward_end(self, task: int) -> None:
        self.streamer._backward_ended(task)


class _AttrHandle:
    """Removes an instance attribute set by the streamer, if it is still ours."""

    def __init__(self, module: nn.Module, name: str, value) -> None:
        self.module, self.name, self.value = module, name, value

    def remove(self) -> None:
        if self.module.__dict__.get(self.name) is self.value:
            del self.module.__dict__[self.name]


def _streaming_device(device: torch.device | str | None) -> torch.device:
    """Where the weights are streamed to: ``device``, or the current CUDA device."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device={str(device)!r} is not supported for layer streaming; use a CUDA device")
        return device
    if not torch.cuda.is_available():
        raise RuntimeError(
            "offloadkit: layer_offloading streams weights to a CUDA GPU and none is available; "
            "turn layer_offloading off on this machine"
        )
    return torch.device("cuda", torch.cuda.current_device())
