"""User-facing constructors with the names users already know.

``get_act_offloading_ctx_manager`` builds an :class:`OffloadActivations` for a model and
wires it to the model: parameters are never offloaded, the output head and whatever
follows it in forward (the loss) stay on the device, and backward starts prefetching as
soon as it reaches the head.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch
from torch import nn

from offloadkit.defaults import MAX_FWD_STASH_SIZE, MIN_OFFLOAD_SIZE
from offloadkit.engine.offload import OffloadActivations
from offloadkit.engine.validation import check_modules
from offloadkit.models.heads import find_output_head, unwrap_model
from offloadkit.runtime.compiled import WHOLE_MODEL_COMPILE_NOTE, compiled_as_a_whole
from offloadkit.transfer.timeline import StepTimeline, TimelineListener

__all__ = ["get_act_offloading_ctx_manager", "get_lora_act_offloading_ctx_manager", "attach_head", "attach_to_forward"]


class _WholeModel(TimelineListener):
    """A whole-model manager's part in the step's timeline: each forward is a new step; the
    head settles in-flight copies before it runs (the logits allocation does not stack on
    activations still being copied), keeps what follows it (the loss) on the device, and
    backward starts prefetching when it reaches the head.

    The head's own saved input is offloaded like any activation: at the loss's memory peak it
    would otherwise sit on the device, and it comes back while the head's backward starts.
    Under offloadkit's checkpointing the tail starts earlier, after the last block (see
    ``CheckpointedBlocks._run_block``): there the blocks' inputs are all the manager offloads."""

    def __init__(self, manager: OffloadActivations) -> None:
        self.manager = manager

    def forward_start(self, module, args) -> None:
        self.manager.forward_pre_hook(module, args)

    def forward_end(self, module, output) -> None:
        self.manager.forward_post_hook(module, (), output)

    def head_start(self) -> None:
        self.manager.flush()

    def head_end(self, output):
        step = self.manager.current_step()
        self.manager.mark_tail()
        if step is None:
            return None
        return lambda: self.manager.begin_backward(step)


class _HeadOnly(_WholeModel):
    def forward_start(self, module, args) -> None:
        pass

    def forward_end(self, module, output) -> None:
        pass


def attach_head(manager: OffloadActivations, head: nn.Module) -> None:
    """Wire the output head alone (:func:`get_act_offloading_ctx_manager` wires it with the
    model): in-flight copies are settled before it runs, everything saved after it (the loss
    over its logits) stays on the device, and backward starts prefetching when it reaches the
    head. Hooks are detached by ``manager.remove()``."""
    timeline = StepTimeline(head=head)
    timeline.subscribe(_HeadOnly(manager))
    manager.add_hook_handle(timeline)


def get_act_offloading_ctx_manager(
    model: nn.Module,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = MIN_OFFLOAD_SIZE,
    max_fwd_stash_size: int = MAX_FWD_STASH_SIZE,
    warn_if_no_head: bool = True,
    *,
    head: nn.Module | None = None,
    exclude: Iterable[nn.Module] = (),
    exclude_liger: bool = True,
    timeline: StepTimeline | None = None,
    **engine_kwargs,
) -> OffloadActivations:
    """An :class:`OffloadActivations` wired to ``model``.

    Args:
        model: the model (may be wrapped by DDP/FSDP ``.module``, torch.compile or PEFT).
        use_pin_memory, use_streams, min_offload_size, max_fwd_stash_size: see
            :class:`OffloadActivations`.
        warn_if_no_head: warn when no output head is found.
        head: the output head, when auto-detection does not fit.
        exclude: further modules whose saved tensors stay on the device.
        exclude_liger: keep modules whose class name contains "Liger" (fused loss
            kernels) on the device.
        timeline: the :class:`~offloadkit.transfer.StepTimeline` of ``model`` to act on,
            shared with layer streaming (its head is the head); None: one of its own.
        **engine_kwargs: forwarded to :class:`OffloadActivations` (``prefetch``,
            ``host_budget_bytes``, ``offload_cpu_tensors``, ...).

    Returns:
        The context manager; use it around the forward (and loss) of each step.

    Example:
        >>> ctx = get_act_offloading_ctx_manager(model)
        >>> with ctx:
        ...     loss = model(input_ids, labels=labels).loss
        >>> loss.backward()
    """
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; pass the model itself "
            "(not its state_dict or a pipeline)"
        )
    exclude = check_modules(head, exclude)
    if compiled_as_a_whole(model):
        warnings.warn(f"offloadkit: {WHOLE_MODEL_COMPILE_NOTE}", UserWarning, stacklevel=2)
    base = unwrap_model(model)
    if timeline is None:
        timeline = StepTimeline(model, head=head if head is not None else find_output_head(base))
        owned = True
    else:
        # A timeline made without the model or the head (a bare engine's) gets them.
        timeline.attach(model, head if head is not None or timeline.head is not None else find_output_head(base))
        owned = False
    manager = OffloadActivations(
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
        timeline=timeline,
        **engine_kwargs,
    )
    manager.track(model)
    manager.add_hook_handle(timeline.subscribe(_WholeModel(manager)))
    if owned:
        manager.add_hook_handle(timeline)
    if timeline.head is None and warn_if_no_head:
        warnings.warn(
            "offloadkit: no output head found (looked for get_output_embeddings(), lm_head, "
            "output, head); the logits and loss will be offloaded too, which is slow. Pass "
            "head=<module> or warn_if_no_head=False.",
            UserWarning,
            stacklevel=2,
        )
    for module in exclude:
        manager.exclude(module)
    if exclude_liger:
        for module in base.modules():
            if "liger" in type(module).__name__.lower():
                manager.exclude(module)
    return manager


def get_lora_act_offloading_ctx_manager(
    model: nn.Module,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = MIN_OFFLOAD_SIZE,
    max_fwd_stash_size: int = MAX_FWD_STASH_SIZE,
    warn_if_no_head: bool = True,
    **kwargs,
) -> OffloadActivations:
    """:func:`get_act_offloading_ctx_manager` for PEFT/LoRA models.

    The head is looked up on the PEFT base model (through ``get_base_model()``), LoRA
    adapter weights are recognised as parameters, and all but the output head's
    activations are offloaded.
    """
    return get_act_offloading_ctx_manager(
        model,
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
        warn_if_no_head=warn_if_no_head,
        **kwargs,
    )


class _ForwardAttachment:
    """Handle of :func:`attach_to_forward`; ``remove()`` detaches it."""

    def __init__(self, handles):
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _EnterEachForward(TimelineListener):
    """Enter the manager around each training forward; it exits even when forward raises
    (the timeline's forward end always runs), so the hooks never stay pushed."""

    def __init__(self, manager: OffloadActivations) -> None:
        self.manager = manager
        self.entered: list[bool] = []

    def forward_start(self, module, args) -> None:
        enter = module.training and torch.is_grad_enabled()
        if enter:
            self.manager.__enter__()
        self.entered.append(enter)

    def forward_end(self, module, output) -> None:
        if self.entered and self.entered.pop():
            self.manager.__exit__(None, None, None)


def attach_to_forward(manager: OffloadActivations, model: nn.Module) -> _ForwardAttachment:
    """Enter ``manager`` around every training forward of ``model`` (grad enabled, training
    mode), for code paths where the step cannot be wrapped in ``with manager:``.

    Example:
        >>> handle = attach_to_forward(get_act_offloading_ctx_manager(model), model)
        >>> trainer.train()  # any loop; backward runs outside the hooks as usual
        >>> handle.remove()
    """
    # On the manager's own timeline when it has one on this model: entering follows its step
    # start, and the exit comes after the pop of a forward on another thread.
    owned = manager.timeline.model is not model  # None once the manager's hooks were removed
    timeline = StepTimeline(model) if owned else manager.timeline
    handles = [timeline.subscribe(_EnterEachForward(manager))]
    return _ForwardAttachment(handles + [timeline] if owned else handles)
