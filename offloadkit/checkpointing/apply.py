"""Activation checkpointing of a model's repeated blocks, optionally offloading their inputs.

Each block's ``forward`` is wrapped (an instance attribute, removed by ``remove()``) in
non-reentrant ``torch.utils.checkpoint``; module hooks stay outside the checkpoint, so
they do not run again during recompute. With ``offload_inputs``, only the tensors the
checkpoint saves (the block's positional inputs) pass through an
:class:`~offloadkit.OffloadActivations`: everything inside a block is recomputed as
usual. The last block's input stays on the device, since backward needs it first.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from offloadkit.checkpointing.selective import selective_context_fn
from offloadkit.engine.offload import OffloadActivations
from offloadkit.models.blocks import find_blocks
from offloadkit.models.heads import unwrap_model
from offloadkit.runtime.autograd import first_grad_fn
from offloadkit.runtime.compiled import compiled_as_a_whole

__all__ = ["apply_activation_checkpointing", "CheckpointedBlocks"]

_MARK = "_offloadkit_checkpoint_forward"


class CheckpointedBlocks:
    """What :func:`apply_activation_checkpointing` attached; ``remove()`` detaches it.

    Attributes:
        blocks: ``(name, module)`` pairs that are checkpointed, in forward order.
        offloader: the manager holding offloaded block inputs, or None.
    """

    def __init__(self, model, blocks, context_fn, offloader, owns_offloader, keep_last_input):
        self.model = model
        self.blocks = blocks
        self.offloader = offloader
        self._owns_offloader = owns_offloader
        self._context_fn = context_fn
        # How many of the last blocks keep their inputs on the device (True: the last one).
        self._keep_last = int(keep_last_input)
        self._outer: OffloadActivations | None = None  # a whole-model manager around the blocks
        self._restore_use_cache = None
        self._attached = False
        self._compiled: dict[int, Callable] = {}  # block index -> its forward compiled, for compiled blocks

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
        config = getattr(unwrap_model(self.model), "config", None)
        if getattr(config, "use_cache", False):
            # A cache written during forward would be written again by the recompute.
            self._restore_use_cache = config
            config.use_cache = False
        self._attached = True

    def remove(self) -> None:
        """Restore every block's forward (and the model's ``use_cache``); close our offloader."""
        if not self._attached:
            return
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
                if value is not None and (key in _CACHE_KEYS or _is_cache(value)):
                    kwargs[key] = None
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
        last = index == len(self.blocks) - 1
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
            fn, flat, kwargs = _keywords_as_positions(original, args, kwargs)
        # Only the checkpoint's own input saves happen in this call (the block's inner saves
        # are discarded and recomputed), so the outer manager's keep region covers exactly them.
        outer = self._outer if kept and self.offloader is None else None
        if outer is not None:
            outer.keep_enter()
        try:
            with capture:
                # The default context is left implicit: torch.compile traces checkpoint() only
                # with a context function it knows (per-layer compile of checkpointed layers).
                selective = {} if self._context_fn is noop_context_fn else {"context_fn": self._context_fn}
                out = checkpoint(fn, *flat, use_reentrant=False, **selective, **kwargs)
        finally:
            if outer is not None:
                outer.keep_exit()
        if self.offloader is not None:
            grad_fn = first_grad_fn(out)
            step = self.offloader.current_step()
            if grad_fn is not None and step is not None:
                # When backward reaches this block, the inputs of the blocks before it start coming back.
                grad_fn.register_prehook(lambda grad_outputs: self.offloader.begin_backward(step))
            if last:
                self.offloader.flush()  # nothing of ours stays in flight into the loss
        return out


# Names a decoder layer's cache argument has had across transformers releases.
_CACHE_KEYS = frozenset({"past_key_values", "past_key_value", "layer_past", "cache"})


def _is_cache(value) -> bool:
    """A transformers cache object, whatever the argument is called (read by type, so a
    renamed keyword in a later release is still caught)."""
    return any(cls.__module__.startswith("transformers.cache_utils") for cls in type(value).__mro__)


def _tensor_leaves(value, out: list) -> object:
    """``value`` with each tensor replaced by its index in ``out`` (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
        return _Slot(len(out) - 1)
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_tensor_leaves(v, out) for v in value)
    if type(value) is dict:
        return {k: _tensor_leaves(v, out) for k, v in value.items()}
    return value


def _rebuild(value, tensors):
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_rebuild(v, tensors) for v in value)
    if type(value) is dict:
        return {k: _rebuild(v, tensors) for k, v in value.items()}
    return value


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _keywords_as_positions(original: Callable, args: tuple, kwargs: dict):
    """A function taking ``(*args, *keyword_tensors)`` that calls ``original`` as before."""
    tensors: list = []
    structure = {k: _tensor_leaves(v, tensors) for k, v in kwargs.items()}
    if not tensors:
        return original, args, kwargs
    n = len(args)

    def call(*flat):
        return original(*flat[:n], **_rebuild(structure, flat[n:]))

    return call, (*args, *tensors), {}


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    block_types: Iterable[type] | None = None,
    predicate: Callable[[str, nn.Module], bool] | None = None,
    selective: Iterable | None = None,
    offload_inputs: bool | OffloadActivations = False,
    prefetch: int | None = None,
    keep_last_input: bool | int = True,
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
    handle = CheckpointedBlocks(model, blocks, context_fn, offloader, owns, keep_last_input)
    handle._attach()
    return handle
