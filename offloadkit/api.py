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
from offloadkit.runtime.autograd import first_grad_fn
from offloadkit.runtime.compiled import WHOLE_MODEL_COMPILE_NOTE, compiled_as_a_whole

__all__ = ["get_act_offloading_ctx_manager", "get_lora_act_offloading_ctx_manager", "attach_head", "attach_to_forward"]


def _eager(hook):
    """A module hook that runs eagerly inside a compiled model: its bookkeeping (the step,
    the tail mark, backward prehooks) is Python state that guards would otherwise watch,
    recompiling the model at every step."""
    return torch.compiler.disable(hook)


def attach_head(manager: OffloadActivations, head: nn.Module) -> None:
    """Wire the output head: in-flight copies are settled before it runs, everything saved
    after it (the loss over its logits) stays on the device, and backward starts
    prefetching when it reaches the head. Hooks are detached by ``manager.remove()``.

    The head's own saved input is offloaded like any activation: at the loss's memory peak
    it would otherwise sit on the device, and it comes back while the head's backward starts.
    """

    def pre_hook(module, args):
        manager.flush()

    def post_hook(module, args, output):
        step = manager.current_step()
        manager.mark_tail()
        grad_fn = first_grad_fn(output)
        if grad_fn is not None and step is not None:
            grad_fn.register_prehook(lambda grad_outputs: manager.begin_backward(step))

    manager.add_hook_handle(head.register_forward_pre_hook(_eager(pre_hook)))
    manager.add_hook_handle(head.register_forward_hook(_eager(post_hook)))


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
    manager = OffloadActivations(
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
        **engine_kwargs,
    )
    manager.track(model)
    base = unwrap_model(model)
    manager.add_hook_handle(model.register_forward_pre_hook(_eager(manager.forward_pre_hook)))
    manager.add_hook_handle(model.register_forward_hook(_eager(manager.forward_post_hook), always_call=True))
    head = head if head is not None else find_output_head(base)
    if head is None:
        if warn_if_no_head:
            warnings.warn(
                "offloadkit: no output head found (looked for get_output_embeddings(), lm_head, "
                "output, head); the logits and loss will be offloaded too, which is slow. Pass "
                "head=<module> or warn_if_no_head=False.",
                UserWarning,
                stacklevel=2,
            )
    else:
        attach_head(manager, head)
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


def attach_to_forward(manager: OffloadActivations, model: nn.Module) -> _ForwardAttachment:
    """Enter ``manager`` around every training forward of ``model`` (grad enabled, training
    mode), for code paths where the step cannot be wrapped in ``with manager:``.

    The post-hook runs even when forward raises, so the hooks never stay pushed.

    Example:
        >>> handle = attach_to_forward(get_act_offloading_ctx_manager(model), model)
        >>> trainer.train()  # any loop; backward runs outside the hooks as usual
        >>> handle.remove()
    """
    entered = []

    def pre(module, args):
        if module.training and torch.is_grad_enabled():
            manager.__enter__()
            entered.append(True)
        else:
            entered.append(False)

    def post(module, args, output):
        if entered and entered.pop():
            manager.__exit__(None, None, None)

    return _ForwardAttachment(
        [
            model.register_forward_pre_hook(_eager(pre)),
            model.register_forward_hook(_eager(post), always_call=True),
        ]
    )
