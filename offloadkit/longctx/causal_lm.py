"""Make a Hugging Face causal LM compute its training loss with :func:`chunked_cross_entropy`.

Hugging Face causal LMs compute ``logits = self.lm_head(hidden_states)``, optionally
transform them (Gemma 2's soft-capping, Cohere's ``logit_scale``, Granite's
``logits_scaling``) and call ``self.loss_function(logits, labels, vocab_size, **kwargs)``.
:func:`apply_chunked_loss` replaces the model instance's ``forward`` with a wrapper. When
``labels`` are given, for the duration of that call only, the head's linear layer returns
an empty ``[..., 0]`` placeholder instead of logits (keeping its input) and the instance's
loss function computes the chunked loss from the head's input and weight. Everything else
in the model's own forward runs unchanged (MoE auxiliary losses are still added). Without
``labels``, or in eval mode (``model.eval()``: evaluation and prediction inside the Trainer's
``train()``), the model runs exactly as before and returns real logits.

In training mode with ``labels``, ``outputs.logits`` is that empty ``[batch, seq, 0]`` tensor.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
from torch import nn

from offloadkit.longctx.loss import _chunk_tokens, chunked_cross_entropy
from offloadkit.models.heads import unwrap_model

__all__ = ["apply_chunked_loss", "ChunkedLossHandle"]

_MARK = "_offloadkit_chunked_loss"
_MISSING = object()


def _plain_linear(module) -> bool:
    return (
        isinstance(module, nn.Linear)
        and type(module).forward is nn.Linear.forward
        and module.weight.is_floating_point()
    )


def _head_linears(head: nn.Module) -> list[nn.Module]:
    """The linear layers the head may call: itself, or a PEFT ``modules_to_save`` wrapper's
    original and trainable copies."""
    if _plain_linear(head):
        return [head]
    if type(head).__name__ == "ModulesToSaveWrapper":
        linears = [head.original_module, *head.modules_to_save.values()]  # type: ignore[operator]
        if all(_plain_linear(m) for m in linears):
            return linears
    raise ValueError(
        f"the output head is a {type(head).__name__}; the chunked loss needs a plain nn.Linear head (also "
        "tied, or in PEFT's modules_to_save). Leave lm_head out of LoRA target_modules and do not quantize "
        "it, or turn chunked_cross_entropy off"
    )


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _scaling_direction(base: nn.Module) -> str | None:
    """How the model's forward applies ``logits_scaling``: "divide" (Granite), "multiply"
    (HyperCLOVA X), or None when its source does not say one way only."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return None
    name = r"self\.(?:config\.)?(?:text_config\.)?logits_scaling"
    divides = re.search(r"/\s*" + name, source) is not None
    multiplies = re.search(r"\*\s*" + name, source) is not None
    if divides != multiplies:
        return "divide" if divides else "multiply"
    return None


def _logit_transform(base: nn.Module) -> tuple[tuple[float, float | None] | None, str | None]:
    """``((scale, softcap), None)`` the model's config says it applies to the logits after
    the head, ``(None, None)`` when it names no such setting, or ``(None, why)`` when it names
    one whose effect offloadkit cannot tell."""
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = _number(getattr(base, "logit_scale", None))
    if scale is None:
        scale = _number(getattr(text, "logit_scale", None))
    scaling = _number(getattr(text, "logits_scaling", None))
    softcap = _number(getattr(text, "final_logit_softcapping", None))
    if scale is None and scaling is None and softcap is None:
        return None, None
    scale = 1.0 if scale is None else scale
    if scaling is not None:
        direction = _scaling_direction(base)
        if direction is None:
            return None, (
                f"{type(base).__name__} sets logits_scaling={scaling} but offloadkit cannot tell from its "
                "forward whether it multiplies or divides the logits by it"
            )
        # Granite divides its logits by logits_scaling; HyperCLOVA X multiplies them (muP).
        scale = scale / scaling if direction == "divide" else scale * scaling
    return (scale, softcap), None


class _Call:
    """The head's input and placeholder for one forward call."""

    def __init__(self, handle: "ChunkedLossHandle") -> None:
        self.handle = handle
        self.hidden: torch.Tensor | None = None
        self.linear: nn.Module | None = None
        self.placeholder: torch.Tensor | None = None

    def capture(self, linear: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden, self.linear = hidden, linear
        # A zero-element output whose grad_fn joins the loss: hooks that others register on
        # the head's output (offloadkit's backward prefetch, layer streaming) still fire as
        # backward starts.
        anchor = torch.zeros((), dtype=hidden.dtype, device=hidden.device, requires_grad=torch.is_grad_enabled())
        self.placeholder = anchor.expand(*hidden.shape[:-1], 0)
        return self.placeholder

    def loss(
        self,
        logits=None,
        labels=None,
        vocab_size=None,
        num_items_in_batch=None,
        ignore_index=-100,
        shift_labels=None,
        **kwargs,
    ):
        handle = self.handle
        if self.hidden is None:
            raise RuntimeError(
                f"{handle.model_name} computed its loss without calling its output head; "
                "apply_chunked_loss cannot be used with this model"
            )
        scale, softcap = None, None
        if logits is not self.placeholder:
            if handle.transform is None:
                why = handle.transform_problem or (
                    f"{handle.model_name} changes its logits after the output head in a way offloadkit does not "
                    "recognise (known: final_logit_softcapping, logit_scale, logits_scaling)"
                )
                raise RuntimeError(f"{why}; remove apply_chunked_loss (chunked_cross_entropy: false) for this model")
            scale, softcap = handle.transform
        hidden, linear = self.hidden, self.linear
        self.hidden = self.linear = None
        loss = chunked_cross_entropy(
            hidden,
            linear.weight,
            labels,
            linear.bias,
            num_chunks=handle.num_chunks,
            chunk_tokens=handle.chunk_tokens,
            ignore_index=ignore_index,
            num_items_in_batch=num_items_in_batch,
            shift_labels=shift_labels,
            logit_scale=scale,
            final_logit_softcapping=softcap,
        )
        if torch.is_tensor(logits) and logits.requires_grad:
            loss = loss + logits.sum().to(loss.dtype)  # adds exactly 0
        return loss


class ChunkedLossHandle:
    """What :func:`apply_chunked_loss` attached; ``remove()`` restores the model's forward.

    Attributes:
        model: the causal LM whose forward is wrapped (inside any PEFT/DDP wrapper).
        head: its output head.
        num_chunks / chunk_tokens: the chunking (None: automatic).
        transform: ``(logit scale, final_logit_softcapping)`` read from the config, applied
            when the model changes its logits after the head; None when the config names
            neither, or names a ``logits_scaling`` whose direction the model's forward does
            not show (``transform_problem`` says which; such a model's loss is refused).
    """

    def __init__(self, model: nn.Module, head: nn.Module, num_chunks, chunk_tokens) -> None:
        self.model = model
        self.head = head
        self.num_chunks = num_chunks
        self.chunk_tokens = chunk_tokens
        self.transform, self.transform_problem = _logit_transform(model)
        self.model_name = type(model).__name__
        self.calls = 0
        self._active = False
        self._previous = None

    def _attach(self) -> None:
        model = self.model
        if _MARK in model.__dict__:
            raise ValueError(f"{self.model_name} already computes a chunked loss; remove() the first handle")
        if "_loss_function" in model.__dict__:
            raise ValueError(f"{self.model_name} has a custom loss_function set; the chunked loss would replace it")
        loss_type = getattr(model, "loss_type", None)
        if loss_type not in (None, "ForCausalLM"):
            raise ValueError(
                f"{self.model_name} uses loss_type={loss_type!r}; the chunked loss is the causal-LM "
                "cross-entropy (ForCausalLM)"
            )
        original = model.forward
        signature = inspect.signature(original)
        if "labels" not in signature.parameters:
            raise ValueError(f"{self.model_name}.forward takes no labels; apply_chunked_loss is for causal LMs")
        self._original, self._signature = original, signature
        # A partial of this handle, not a closure: a deep copy of the model (a reference model,
        # an EMA copy) deep-copies the handle with it and runs its own weights.
        forward = functools.update_wrapper(functools.partial(ChunkedLossHandle._forward, self), original)
        self._previous = model.__dict__.get("forward")
        model.forward = forward
        model.__dict__[_MARK] = forward
        self._active = True

    def _forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        if labels is None and args:
            labels = self._signature.bind_partial(*args, **kwargs).arguments.get("labels")
        # Evaluation and prediction need real logits (compute_metrics, generate); the chunked
        # loss is for training steps.
        if labels is None or not self._active or not self.model.training:
            return self._original(*args, **kwargs)
        return self._run(self._original, args, kwargs)

    def _run(self, original, args, kwargs):
        call = _Call(self)
        model = self.model
        linears = _head_linears(self.head)
        saved = [(m, m.__dict__.get("forward", _MISSING)) for m in linears]
        previous_loss = model.__dict__.get("_loss_function", _MISSING)
        for m in linears:
            m.forward = functools.partial(call.capture, m)
        model.__dict__["_loss_function"] = call.loss
        try:
            out = original(*args, **kwargs)
        finally:
            for m, prev in saved:
                if prev is _MISSING:
                    del m.forward
                else:
                    m.forward = prev
            if previous_loss is _MISSING:
                model.__dict__.pop("_loss_function", None)
            else:
                model.__dict__["_loss_function"] = previous_loss
        self.calls += 1
        return out

    def remove(self) -> None:
        """Restore the model's own forward (logits and loss computed as before)."""
        if not self._active:
            return
        self._active = False
        ours = self.model.__dict__.pop(_MARK, None)
        if ours is not None and self.model.__dict__.get("forward") is ours:
            if self._previous is None:
                del self.model.forward
            else:
                self.model.forward = self._previous


def apply_chunked_loss(
    model: nn.Module, num_chunks: int | None = None, *, chunk_tokens: int | None = None
) -> ChunkedLossHandle:
    """Compute a Hugging Face causal LM's loss over token chunks, never holding full logits.

    Works on ``LlamaForCausalLM`` and the other ``*ForCausalLM`` models with a linear
    ``lm_head`` (tied or not, frozen or trainable), also inside PEFT, DDP or compile
    wrappers. Only the model instance is changed. In training mode with ``labels`` the
    returned ``outputs.logits`` is an empty ``[batch, seq, 0]`` tensor; without ``labels`` or
    in eval mode nothing changes.

    Args:
        model: the causal LM (or its PEFT model).
        num_chunks / chunk_tokens: see :func:`chunked_cross_entropy` (None: automatic,
            at most 1 GiB of fp32 logits per chunk).

    Returns:
        A :class:`ChunkedLossHandle`; ``handle.remove()`` restores the model.

    Raises:
        ValueError: for a head that is not a plain linear layer (LoRA on ``lm_head``,
            quantized heads) or a model whose loss is not the causal-LM cross-entropy.

    Example:
        >>> handle = apply_chunked_loss(model)
        >>> model(input_ids=ids, labels=ids).loss.backward()
        >>> handle.remove()
    """
    _chunk_tokens(1, 1, num_chunks, chunk_tokens)  # validates the arguments early
    base = unwrap_model(model)
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        raise ValueError(
            f"{type(base).__name__} has no output head (get_output_embeddings() returned "
            f"{type(head).__name__}); apply_chunked_loss is for Hugging Face causal LMs"
        )
    for linear in _head_linears(head):
        if hasattr(linear, "_hf_hook"):
            raise ValueError(
                "the output head is driven by accelerate hooks (device_map offload); the chunked "
                "loss needs the head's weight on the device of the hidden states"
            )
    handle = ChunkedLossHandle(base, head, num_chunks, chunk_tokens)
    handle._attach()
    return handle
