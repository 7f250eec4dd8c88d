"""Activation checkpointing of a model's repeated blocks, optionally offloading their inputs.

Each block's ``forward`` is wrapped (an instance attribute, removed by ``remove()``) in
non-reentrant ``torch.utils.checkpoint``; module hooks stay outside the checkpoint, so
they do not run again during recompute. With ``offload_inputs``, only the tensors the
checkpoint saves (the block's positional inputs) pass through an
:class:`~offloadkit.OffloadActivations`: everything inside a block is recomputed as
usual. The last block's input stays on the device, since backward needs it first.

With ``recompute_inputs``, the inputs of the blocks named there are not kept at all: a run of
such blocks shares one checkpoint region with the kept block before it, whose input is the
only one saved. In backward the region replays those blocks' forward from that input (each
block still checkpointed inside it), so each dropped input costs one more forward of the
blocks before it in its run, and no storage.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn
from torch.utils.hooks import RemovableHandle

from offloadkit.checkpointing.arguments import CACHE_KEYS, first_tensor, is_cache, keywords_as_positions
from offloadkit.checkpointing.attention import AttentionKeepStats, KeptAttention
from offloadkit.checkpointing.selective import selective_context_fn
from offloadkit.defaults import BLOCK_INPUT_PLACES
from offloadkit.engine.offload import OffloadActivations
from offloadkit.models.blocks import find_blocks
from offloadkit.models.heads import unwrap_model
from offloadkit.parallel.compat import fsdp2_sharded, recompute_refusal
from offloadkit.runtime.compiled import compiled_as_a_whole
from offloadkit.runtime.recompute import discarding_recompute
from offloadkit.runtime.regions import checkpoint_region
from offloadkit.transfer.timeline import TimelineListener

__all__ = ["apply_activation_checkpointing", "CheckpointedBlocks"]

_MARK = "_offloadkit_checkpoint_forward"


class CheckpointedBlocks:
    """What :func:`apply_activation_checkpointing` attached; ``remove()`` detaches it.

    Attributes:
        blocks: ``(name, module)`` pairs that are checkpointed, in forward order.
        offloader: the manager holding offloaded block inputs, or None.
    """

    def __init__(
        self,
        model,
        blocks,
        context_fn,
        offloader,
        owns_offloader,
        keep_last_input,
        recompute_inputs=(),
        places=None,
        keep_attention=False,
    ):
        self.model = model
        # Blocks whose fused attention outputs are kept from forward for the recompute
        # (checkpointing/attention.py): every one (True) or the last ``keep_attention``.
        kept = len(blocks) if keep_attention is True else int(keep_attention)
        self.keep_attention = frozenset(range(max(0, len(blocks) - kept), len(blocks)))
        self.attention_stats = AttentionKeepStats()
        self._warned_keep = False
        self.blocks = blocks
        self.recompute_inputs = frozenset(recompute_inputs)
        # Per block: where its input goes when offloaded ("gpu", "ram", "disk"), or None (the
        # storage tier's choice); from a plan's block_input_placement.
        self.places: list[str | None] = list(places) if places is not None else [None] * len(blocks)
        # First block of each run -> its last dropped block: the span of one checkpoint region.
        self._region_end: dict[int, int] = {}
        for index in range(len(blocks)):
            if index not in self.recompute_inputs and index + 1 in self.recompute_inputs:
                end = index + 1
                while end + 1 in self.recompute_inputs:
                    end += 1
                self._region_end[index] = end
        self._region = None  # the open region: (context manager, its last block, recorded calls)
        self._forward_hook = None
        self._timeline_handles: list = []
        self._index_of: dict[int, int] = {}  # id(block) -> its index in self.blocks
        self.offloader = offloader
        self._owns_offloader = owns_offloader
        self._context_fn = context_fn
        # How many of the last blocks keep their inputs on the device (True: the last one).
        self._keep_last = int(keep_last_input)
        self._outer: OffloadActivations | None = None  # a whole-model manager around the blocks
        self._restore_use_cache = None
        self._attached = False
        self._compiled: dict[int, Callable] = {}  # block index -> its forward compiled, for compiled blocks
        self._replay_hooks: OrderedDict[int, Callable[[nn.Module], None]] = OrderedDict()  # weakref-able

    # -- wiring ------------------------------------------------------------------------
    def _attach(self) -> None:
        for index, (name, block) in enumerate(self.blocks):
            if getattr(block, "gradient_checkpointing", False):
                raise ValueError(
                    f"{name} already has Hugging Face gradient checkpointing on; call "
                    "model.gradient_checkpointing_disable() before apply_activation_checkpointing"
                )
            if _MARK in block.__dict__:
                raise ValueError(f"{name} is already checkpointed by offloadkit; remove() the first handle")
            original = block.forward
            wrapper = functools.partial(self._run, index, block, original)
            block.forward = wrapper
            block.__dict__[_MARK] = wrapper
        if self.offloader is not None:
            # Backward reaching a block's output brings the inputs of the blocks before it.
            timeline = self.offloader.timeline
            self._index_of = {id(block): index for index, (_, block) in enumerate(self.blocks)}
            self._timeline_handles = [
                timeline.watch_blocks(block for _, block in self.blocks),
                timeline.subscribe(_InputsBackward(self)),
            ]
        if self._region_end:
            # Also when the forward raises: a region left open would keep its saved-tensor hooks
            # on this thread, and any other model's forward would save into it.
            self._forward_hook = self.model.register_forward_hook(
                lambda *_: self._close_stale_region(), always_call=True
            )
        config = getattr(unwrap_model(self.model), "config", None)
        if getattr(config, "use_cache", False):
            # A cache written during forward would be written again by the recompute.
            self._restore_use_cache = config
            config.use_cache = False
        self._attached = True

    def _close_stale_region(self) -> None:
        """A forward that raised between a region's first and last block (in a hook, say) left
        its saved-tensor hooks installed: remove them."""
        if self._region is not None:
            (stale, _, _, capture), self._region = self._region, None
            abandoned = RuntimeError("forward abandoned")
            stale.__exit__(RuntimeError, abandoned, None)
            capture.__exit__(RuntimeError, abandoned, None)

    def remove(self) -> None:
        """Restore every block's forward (and the model's ``use_cache``); close our offloader."""
        if not self._attached:
            return
        self._close_stale_region()
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        for handle in self._timeline_handles:
            handle.remove()
        self._timeline_handles = []
        for _, block in self.blocks:
            if block.__dict__.get(_MARK) is not None and block.__dict__.get("forward") is block.__dict__[_MARK]:
                del block.forward
            block.__dict__.pop(_MARK, None)
        if self._restore_use_cache is not None:
            self._restore_use_cache.use_cache = True
        if self.offloader is not None and self._owns_offloader:
            self.offloader.close()
        self._outer = None
        self._attached = False

    def keep_last_input_from(self, manager: OffloadActivations | None) -> None:
        """Keep the last block's inputs on the device when ``manager`` (a whole-model
        :class:`~offloadkit.OffloadActivations` around these blocks, not their own
        ``offload_inputs``) would otherwise offload them: backward needs them first, so moving
        them out only costs a round trip and a block input's worth of host or disk space at
        the end of forward. Does nothing with ``keep_last_input=False``; None unlinks.

        Example:
            >>> handle = apply_activation_checkpointing(model)
            >>> manager = get_act_offloading_ctx_manager(model)
            >>> handle.keep_last_input_from(manager)
        """
        self._outer = manager

    # -- per block -----------------------------------------------------------------------
    def _inner(self, index: int, block: nn.Module, original: Callable) -> Callable:
        """What the checkpoint runs: the block's forward, compiled when the block was compiled
        (``layer.compile()``), so regional compile keeps its kernels while the checkpoint and
        the offloading around them run eagerly."""
        if not compiled_as_a_whole(block):
            return original
        if index not in self._compiled:
            self._compiled[index] = torch.compile(original)
        return self._compiled[index]

    @torch.compiler.disable
    def _run(self, index: int, block: nn.Module, original: Callable, *args, **kwargs):
        # Runs eagerly even inside a compiled model: the checkpoint's bookkeeping and the
        # offloader's hooks are Python side effects that a graph cannot hold.
        original = self._inner(index, block, original)
        if not (torch.is_grad_enabled() and block.training):
            return original(*args, **kwargs)
        if not getattr(block, "_can_checkpoint_with_cache", False):
            # A cache written in forward would be read (or written again) by the recompute,
            # which then saves different tensors: blocks run without one when checkpointed.
            for key, value in kwargs.items():
                if value is not None and (key in CACHE_KEYS or is_cache(value)):
                    kwargs[key] = None
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
        if self._region_end.get(index) is not None or self._region is not None:
            return self._run_in_region(index, block, original, args, kwargs)
        return self._run_block(index, block, original, args, kwargs)

    @property
    def _manager(self):
        """What stores block inputs: the blocks' own offloader, else the whole-model manager."""
        return self.offloader if self.offloader is not None else self._outer

    def _placed(self, index: int):
        """The planned place of block ``index``'s input, for the manager that takes it."""
        where = self.places[index]
        manager = self._manager
        if where is None or manager is None:
            return contextlib.nullcontext()
        return manager.placed(where)

    def _recompute(self, fn: Callable, block: nn.Module) -> Callable:
        """``fn`` (``block``'s forward) for one checkpoint, its recompute marked as one whose
        output, ``block``'s, nothing reads (``runtime/recompute.py``). Not with selective
        checkpointing, whose recompute replays the forward's cached results in order."""
        return discarding_recompute(fn, block) if self._context_fn is noop_context_fn else fn

    def _recompute_block(self, fn: Callable, index: int, block: nn.Module) -> Callable:
        """As :meth:`_recompute`, for a block checkpointed on its own: with ``keep_attention``
        its attention outputs go to the block-input storage for the recompute. Not inside
        replayed runs (their blocks run forward again in backward anyway) nor in a block
        compiled whole (a graph runs the kernels, not the dispatcher)."""
        manager = self._manager
        if index not in self.keep_attention or self._context_fn is not noop_context_fn or compiled_as_a_whole(block):
            return self._recompute(fn, block)
        if manager is None:
            if not self._warned_keep:
                self._warned_keep = True
                warnings.warn(
                    "offloadkit: keep_attention has no effect without block-input offloading (offload_inputs=True, "
                    "or keep_last_input_from(manager)): the outputs wait in the block-input storage",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return self._recompute(fn, block)
        return KeptAttention(fn, manager, self.attention_stats, block)

    def _selective(self) -> dict:
        # The default context is left implicit: torch.compile traces checkpoint() only with a
        # context function it knows (per-layer compile of checkpointed layers).
        return {} if self._context_fn is noop_context_fn else {"context_fn": self._context_fn}

    def _run_in_region(self, index: int, block: nn.Module, original: Callable, args: tuple, kwargs: dict):
        """A block in a run whose inputs are dropped: the run's first block opens the region
        (saving its own input, offloaded like any block input), the last one closes it."""
        if self._region is None:
            if fsdp2_sharded(block) is not None:  # sharded after checkpointing was applied
                raise RuntimeError(recompute_refusal(self.blocks[index][0]))
            end = self._region_end[index]
            fn, flat, rest = original, args, kwargs
            if self.offloader is not None or not args:
                # As for a single block: keyword tensors become positions so that our offloader
                # takes them (a whole-model manager around us keeps them by reference, as it
                # does the other blocks' keyword tensors).
                fn, flat, rest = keywords_as_positions(original, args, kwargs)
            calls: list = []
            region = checkpoint_region(functools.partial(self._replay, calls), *flat, **rest)
            capture = self.offloader.capture() if self.offloader is not None else contextlib.nullcontext()
            if index == 0 and self.offloader is not None:
                self.offloader.policy.refresh()
            # Saved-tensor hooks form a stack: the offloader's (which takes the region's inputs)
            # stays under the region's until the region closes, inert while it is covered.
            capture.__enter__()
            try:
                with self._placed(index):  # the region saves its input as it opens
                    region.__enter__()
            except BaseException as exc:
                capture.__exit__(type(exc), exc, exc.__traceback__)
                raise
            self._region = (region, end, calls, capture)
            args, kwargs, original = flat, rest, fn
        region, end, calls, capture = self._region
        try:
            chained = calls and args and isinstance(args[0], torch.Tensor) and args[0] is calls[-1][-1]()
            if calls and not chained:
                raise RuntimeError(
                    f"recompute_inputs: block {index} was not called with the previous block's output as its first "
                    "argument; a dropped input is replayed from the block before it, so blocks must be chained"
                )
            out = checkpoint(
                self._recompute(original, block), *args, use_reentrant=False, **self._selective(), **kwargs
            )
            # The output by weak reference: holding it would keep the dropped input alive. The
            # first block replays from the region's own saved arguments: nothing kept for it.
            more, kw = (args[1:], kwargs) if calls else ((), {})
            calls.append((index, original, more, kw, weakref.ref(first_tensor(out))))
        except BaseException as exc:
            self._region = None
            region.__exit__(type(exc), exc, exc.__traceback__)
            capture.__exit__(type(exc), exc, exc.__traceback__)
            raise
        if index == end:
            self._region = None
            region.__exit__(None, None, None)
            capture.__exit__(None, None, None)
        return out

    def register_replay_hook(self, hook: Callable[[nn.Module], None]) -> RemovableHandle:
        """Call ``hook(block)`` before each block a region replays in backward.

        A replay runs blocks' forward outside their module hooks (those ran in forward), at a
        time when backward has only reached the region's last block: whatever a block needs in
        place to run (its streamed weights, say) must be put there by such a hook.

        Returns:
            A handle whose ``remove()`` detaches the hook.
        """
        handle = RemovableHandle(self._replay_hooks)
        self._replay_hooks[handle.id] = hook
        return handle

    def _replay(self, calls: list, *flat, **rest) -> None:
        """Recompute a region in backward: its blocks' forward again, each checkpointed as in
        forward, from the region's saved input (module hooks do not run again; replay hooks do)."""
        hidden = None
        for n, (index, original, more, kwargs, _) in enumerate(calls):
            for hook in tuple(self._replay_hooks.values()):
                hook(self.blocks[index][1])
            args, kw = (flat, rest) if n == 0 else ((hidden, *more), kwargs)
            hidden = first_tensor(
                checkpoint(
                    self._recompute(original, self.blocks[index][1]),
                    *args,
                    use_reentrant=False,
                    **self._selective(),
                    **kw,
                )
            )

    def _after_block(self, block: nn.Module, out):
        """What backward does on reaching ``block``'s output: start bringing the inputs of
        the blocks before it (None outside a training forward with our offloader)."""
        index = self._index_of.get(id(block))
        if index is None or not (torch.is_grad_enabled() and block.training) or self.offloader is None:
            return None
        step = self.offloader.current_step()
        if index == len(self.blocks) - 1:
            self.offloader.flush()  # nothing of ours stays in flight into the loss
        if step is None:
            return None
        offloader = self.offloader
        return lambda: offloader.begin_backward(step)

    def _run_block(self, index: int, block: nn.Module, original: Callable, args: tuple, kwargs: dict):
        if index == 0 and self.offloader is not None:
            self.offloader.policy.refresh()  # once per forward: parameters may have moved
        kept = index >= len(self.blocks) - self._keep_last
        offload = self.offloader is not None and not kept
        capture = self.offloader.capture() if offload else contextlib.nullcontext()
        fn, flat = original, args
        if offload and kwargs:
            # The checkpoint saves positional tensors through the saved-tensor hooks but keeps
            # keyword arguments as plain Python objects: move keyword tensors to positions so
            # they are offloaded like the rest (``hidden_states=`` callers).
            fn, flat, kwargs = keywords_as_positions(original, args, kwargs)
        # Only the checkpoint's own input saves happen in this call (the block's inner saves
        # are discarded and recomputed), so the outer manager's keep region covers exactly them.
        outer = self._outer if kept and self.offloader is None else None
        if outer is not None:
            outer.keep_enter()
        try:
            with capture, self._placed(index) if not kept else contextlib.nullcontext():
                out = checkpoint(
                    self._recompute_block(fn, index, block), *flat, use_reentrant=False, **self._selective(), **kwargs
                )
        finally:
            if outer is not None:
                outer.keep_exit()
        if outer is not None and index == len(self.blocks) - 1:
            # What is saved after the last block (the final norm, the loss) is what backward
            # needs first, before any block's recompute, when the GPU is below its peak: it
            # stays where it is rather than go to the host and straight back.
            self._outer.mark_tail()
        return out


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    block_types: Iterable[type] | None = None,
    predicate: Callable[[str, nn.Module], bool] | None = None,
    selective: Iterable | None = None,
    offload_inputs: bool | OffloadActivations = False,
    prefetch: int | None = None,
    keep_last_input: bool | int = True,
    recompute_inputs: Iterable[int] = (),
    placement: Sequence[str] | None = None,
    keep_attention: bool | int = False,
    **offload_kwargs,
) -> CheckpointedBlocks:
    """Checkpoint every repeated block of ``model`` (non-reentrant).

    Args:
        model: any module; Hugging Face and PEFT models are handled automatically.
        block_types / predicate: name the blocks explicitly (see :func:`find_blocks`).
        selective: ops whose outputs are saved instead of recomputed, e.g.
            ``("mm", "attention")`` or aten overloads; None recomputes everything.
        offload_inputs: offload block inputs to pinned host memory (True, or a ready
            :class:`OffloadActivations` to use).
        prefetch: block inputs brought back ahead in backward (``activation_loading_horizon``;
            None: 2 from RAM, 4 from disk).
        keep_last_input: keep the last block's input on the device (needed first); an int
            keeps that many of the last blocks' inputs (a GPU with room to spare).
        recompute_inputs: indices of blocks whose inputs are not kept anywhere: backward
            recomputes each from the nearest kept input before it, running the blocks in
            between forward again (exact: the same kernels on the same values). Block 0's
            input cannot be dropped. With layer streaming, pass the streamer's loads in:
            ``handle.register_replay_hook(streamer.make_resident)`` (the config route does).
        placement: per block, where its input waits for backward: "gpu", "ram", "disk" or
            "recompute" (a plan's ``block_input_placement``). Replaces ``keep_last_input``
            (the trailing "gpu" blocks are the kept ones) and ``recompute_inputs``; "ram" and
            "disk" are honoured by a tiered store (``activation_offloading: disk`` with
            ``disk_tiering``), where they override its oldest-to-disk order.
        keep_attention: with ``offload_inputs``, copy each fused attention kernel's output and
            log-sum-exp (SDPA's cuDNN, flash or efficient kernel) to the block-input storage in
            forward, and hand them back to the recompute instead of running the kernel again
            (bitwise the same; the kernel runs where the storage has no room). Pays at long
            context, where attention is most of a layer's recompute. An int keeps them for
            that many of the last blocks (what the storage holds). Without ``offload_inputs``
            it uses the manager given to :meth:`CheckpointedBlocks.keep_last_input_from`.
        **offload_kwargs: forwarded to :class:`OffloadActivations` when one is created.

    Returns:
        A :class:`CheckpointedBlocks` handle; ``handle.remove()`` undoes everything.

    Example:
        >>> handle = apply_activation_checkpointing(model, offload_inputs=True)
        >>> loss = model(**batch).loss; loss.backward()
        >>> handle.remove()
    """
    if not isinstance(keep_last_input, (bool, int)) or keep_last_input < 0:
        raise ValueError(
            f"keep_last_input={keep_last_input!r} is invalid; pass True/False or how many of the last "
            "blocks keep their inputs on the device (an int >= 0)"
        )
    blocks = find_blocks(model, tuple(block_types) if block_types is not None else None, predicate)
    places = None
    if placement is not None:
        places, keep_last_input, recompute_inputs = _from_placement(placement, len(blocks), recompute_inputs)
    dropped = sorted(set(recompute_inputs))
    if any(not isinstance(i, int) or i < 1 or i >= len(blocks) for i in dropped):
        raise ValueError(
            f"recompute_inputs={dropped!r} is invalid; name blocks by index, 1 to {len(blocks) - 1} "
            "(block 0's input has nothing before it to be recomputed from)"
        )
    sharded = next((name for name, block in blocks if fsdp2_sharded(block) is not None), None) if dropped else None
    if sharded is not None:
        raise ValueError(recompute_refusal(sharded))
    context_fn = noop_context_fn if selective is None else selective_context_fn(selective)
    owns = False
    offloader = None
    if isinstance(offload_inputs, OffloadActivations):
        offloader = offload_inputs
    elif offload_inputs:
        offload_kwargs.setdefault("prefetch_bytes", 0)  # block inputs are uniform: count them
        offloader = OffloadActivations(prefetch=prefetch, **offload_kwargs)
        owns = True
    elif offload_kwargs:
        raise ValueError(f"{sorted(offload_kwargs)} only apply with offload_inputs=True")
    if offloader is not None:
        offloader.track(model)
    handle = CheckpointedBlocks(
        model, blocks, context_fn, offloader, owns, keep_last_input, dropped, places, keep_attention
    )
    handle._attach()
    return handle


def _from_placement(placement: Sequence[str], blocks: int, recompute_inputs: Iterable[int]):
    """``(places, keep_last_input, recompute_inputs)`` that realise a per-block placement."""
    placement = list(placement)
    allowed = BLOCK_INPUT_PLACES
    if len(placement) != blocks or any(p not in allowed for p in placement) or placement[:1] == ["recompute"]:
        raise ValueError(
            f"placement={placement!r} is invalid; give one place per block ({blocks} blocks), each one of "
            f"{', '.join(allowed)}, block 0's not recompute"
        )
    if list(recompute_inputs):
        raise ValueError("recompute_inputs and placement both drop block inputs; give only placement")
    kept_last = len(list(itertools.takewhile(lambda p: p == "gpu", reversed(placement))))
    places = [p if p != "recompute" else None for p in placement]
    return places, kept_last, [i for i, p in enumerate(placement) if p == "recompute"]


class _InputsBackward(TimelineListener):
    """Checkpoint-input offload's part in its engine's timeline."""

    def __init__(self, handle: CheckpointedBlocks) -> None:
        self.handle = handle

    def block_end(self, block, output):
        return self.handle._after_block(block, output)
