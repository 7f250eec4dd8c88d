"""Cross-entropy over the output head without full-vocabulary logits.

The head projection and the loss run over chunks of tokens. For each chunk the forward
pass computes the logits, their log-sum-exp in fp32 and, when backward will need them,
the gradients with respect to the hidden states (and the head's weight and bias when they
require grad); the chunk's logits are then freed. Backward only scales the stored
gradients by the incoming gradient.

Why gradients in forward rather than logits recomputed in backward: both hold one
chunk's logits at a time and end up holding a hidden-states-sized gradient, so their
peaks are the same, but recomputation costs one more head matmul per step and keeps the
hidden states alive until backward. Here the matmul count equals the unchunked path's
(one for the logits, one per gradient), and the hidden states can be freed after forward.
The exception is an fp16 head (fp16 inputs, or autocast to fp16): fp16's range cannot hold
the gradients before the loss scale reaches them, so they are computed in backward from
the saved hidden states and the log-sum-exp (one more head matmul; the same memory, as the
hidden states take the place of their gradient). Double backward is not supported.

Automatic chunk size: ``2**28 // vocab`` tokens, so a chunk's fp32 logits are at most
1 GiB (268M elements, far below the 2**31 elements that some kernels index with 32 bits).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

__all__ = ["chunked_cross_entropy", "auto_chunk_tokens", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 2**28  # fp32 logits elements per chunk in automatic mode: 1 GiB
_MAX_CHUNK_ELEMENTS = 2**31 - 1


def auto_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk in automatic mode: a chunk's fp32 logits stay within 1 GiB."""
    return max(1, CHUNK_ELEMENTS // max(1, int(vocab_size)))


def _chunk_tokens(n_tokens: int, vocab: int, num_chunks: int | None, chunk_tokens: int | None) -> int:
    if num_chunks is not None and chunk_tokens is not None:
        raise ValueError("pass num_chunks or chunk_tokens, not both")
    if num_chunks is not None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"num_chunks={num_chunks!r} must be an integer >= 1 (or None for automatic)")
        size = max(1, math.ceil(n_tokens / num_chunks))
        how = f"num_chunks={num_chunks}"
    elif chunk_tokens is not None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1 (or None for automatic)")
        size = chunk_tokens
        how = f"chunk_tokens={chunk_tokens}"
    else:
        return auto_chunk_tokens(vocab)
    if min(size, n_tokens) * vocab > _MAX_CHUNK_ELEMENTS:
        raise ValueError(
            f"{how} gives chunks of {size} tokens x {vocab} vocab = {size * vocab} logits, over 2**31; "
            f"use more chunks (at most {auto_chunk_tokens(vocab)} tokens each) or None for automatic"
        )
    return size


def _chunk_logits(h, w, b, scale, softcap, compute_dtype, acc_dtype):
    """One chunk's logits in ``acc_dtype`` after scaling and soft-capping, and the tanh
    that soft-capping's derivative needs (None without it)."""
    if h.dtype != compute_dtype:
        h = h.to(compute_dtype)
    z = torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())
    z = z.to(acc_dtype) if z.dtype != acc_dtype else z
    if scale != 1.0:
        z.mul_(scale)
    tanh = None
    if softcap is not None:
        tanh = z.div_(softcap).tanh_()
        z = tanh * softcap
    return h, z, tanh


def _logits_grad_(z, tanh, lab, tw, scale, sums=None):
    """Turn ``z = exp(logits - max) / sums`` (softmax; ``sums`` None when already divided)
    into d(loss)/d(head output) in place: ``tw * (softmax - onehot)`` through soft-capping
    and scaling."""
    z.mul_(tw.unsqueeze(1) if sums is None else tw.unsqueeze(1) / sums)
    z.scatter_add_(1, lab.clamp(min=0).unsqueeze(1), -tw.unsqueeze(1))
    if tanh is not None:
        z.mul_(tanh.mul_(tanh).neg_().add_(1))
    if scale != 1.0:
        z.mul_(scale)
    return z


def _chunk_grads(z, h, w, start, end, grad_h, grad_w, grad_b, compute_dtype):
    """Add one chunk's head-output gradient ``z`` (acc dtype) into the hidden, weight and
    bias gradients."""
    if grad_b is not None:
        grad_b += z.sum(dim=0)
    dz = z.to(compute_dtype) if z.dtype != compute_dtype else z
    if grad_h is not None:
        if grad_h.dtype == compute_dtype:
            torch.mm(dz, w, out=grad_h[start:end])
        else:
            grad_h[start:end].copy_(torch.mm(dz, w))
    if grad_w is not None:
        # A chunk's product is rounded once in the compute dtype; the sum over chunks is
        # kept in fp32 so that many chunks do not add rounding error.
        grad_w += torch.mm(dz.t(), h)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, token_weight, denom, opts):
        chunk, scale, softcap, need_h, need_w, need_b, compute_dtype = opts
        acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        need_any = need_h or need_w or need_b
        # fp16 has 5 exponent bits: a gradient folded with 1/N in forward and rounded to
        # fp16 before the loss scale reaches it underflows (softmax terms of a 128K vocab
        # over 16K tokens are below fp16's smallest subnormal), and an fp16 gradient times
        # GradScaler's 65536 overflows. So under fp16 the gradients are computed in backward,
        # where the incoming gradient (the loss scale) is known, and rounded to fp16 once,
        # exactly where the unchunked loss rounds them. The cost: the head matmul again.
        deferred = need_any and compute_dtype == torch.float16
        n_tokens = hidden.shape[0]
        device_type = hidden.device.type
        with torch.autocast(device_type, enabled=False):
            w = weight if weight.dtype == compute_dtype else weight.to(compute_dtype)
            b = None if bias is None else bias if bias.dtype == compute_dtype else bias.to(compute_dtype)
            now = need_any and not deferred
            grad_h = torch.empty_like(hidden) if now and need_h else None
            grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if now and need_w else None
            grad_b = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if now and need_b else None
            lse_all = torch.empty(n_tokens, dtype=acc_dtype, device=hidden.device) if deferred else None
            total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
            for start in range(0, n_tokens, chunk):
                end = min(start + chunk, n_tokens)
                h, z, tanh = _chunk_logits(hidden[start:end], w, b, scale, softcap, compute_dtype, acc_dtype)
                lab = labels[start:end]
                valid = lab >= 0  # ignored positions were set to -1 by the caller
                target = z.gather(1, lab.clamp(min=0).unsqueeze(1)).squeeze(1)
                top = z.amax(dim=1, keepdim=True)
                # z becomes exp(z - max) in place: the chunk holds a single fp32 buffer.
                z.sub_(top).exp_()
                sums = z.sum(dim=1, keepdim=True)
                lse = (top + sums.log()).squeeze(1)
                total += torch.where(valid, lse - target, 0).sum()
                if deferred:
                    lse_all[start:end] = lse
                elif now:
                    _logits_grad_(z, tanh, lab, token_weight[start:end].to(acc_dtype), scale, sums)
                    _chunk_grads(z, h, w, start, end, grad_h, grad_w, grad_b, compute_dtype)
                del z, tanh, target, top, sums, lse
            loss = total / denom
        if deferred:
            ctx.save_for_backward(hidden, weight, bias, labels, token_weight, lse_all)
        else:
            ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.deferred = deferred
        ctx.opts = opts
        ctx.param_dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        w_dtype, b_dtype = ctx.param_dtypes
        if ctx.deferred:
            grad_h, grad_w, grad_b = _deferred_grads(ctx, grad_loss)
            out_h = grad_h
            out_w = None if grad_w is None else grad_w.to(w_dtype)
            out_b = None if grad_b is None else grad_b.to(b_dtype)
        else:
            grad_h, grad_w, grad_b = ctx.saved_tensors
            out_h = None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype)
            out_w = None if grad_w is None else (grad_w * grad_loss).to(w_dtype)
            out_b = None if grad_b is None else (grad_b * grad_loss).to(b_dtype)
        return out_h, out_w, out_b, None, None, None, None


def _deferred_grads(ctx, grad_loss):
    """The fp16 path's gradients (see forward), computed with ``grad_loss`` folded in
    before any rounding to fp16.

    Returns:
        The hidden gradient (hidden's dtype) and the weight and bias gradients (fp32 sums),
        each already multiplied by ``grad_loss``; None for those not needed.
    """
    hidden, weight, bias, labels, token_weight, lse_all = ctx.saved_tensors
    chunk, scale, softcap, need_h, need_w, need_b, compute_dtype = ctx.opts
    acc_dtype = lse_all.dtype
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight if weight.dtype == compute_dtype else weight.to(compute_dtype)
        b = None if bias is None else bias if bias.dtype == compute_dtype else bias.to(compute_dtype)
        # The loss scale folds into the token weight in fp32, so the head-output gradient
        # is rounded to fp16 once, as large as the unchunked loss's.
        tw_all = token_weight.to(acc_dtype) * grad_loss.to(acc_dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b else None
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h, z, tanh = _chunk_logits(hidden[start:end], w, b, scale, softcap, compute_dtype, acc_dtype)
            z.sub_(lse_all[start:end].unsqueeze(1)).exp_()
            _logits_grad_(z, tanh, labels[start:end], tw_all[start:end], scale)
            _chunk_grads(z, h, w, start, end, grad_h, grad_w, grad_b, compute_dtype)
            del z, tanh
    return grad_h, grad_w, grad_b


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden_states are {hidden.dtype} but head_weight is {weight.dtype}; "
            "cast one of them, or run under torch.autocast"
        )
    return hidden.dtype


def chunked_cross_entropy(
    hidden_states: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor | None,
    head_bias: torch.Tensor | None = None,
    *,
    num_chunks: int | None = None,
    chunk_tokens: int | None = None,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    shift: bool = True,
    shift_labels: torch.Tensor | None = None,
    logit_scale: float | None = None,
    final_logit_softcapping: float | None = None,
) -> torch.Tensor:
    """Causal-LM cross-entropy of ``hidden_states @ head_weight.T (+ head_bias)`` without
    ever holding the full-vocabulary logits.

    Matches Hugging Face's ``ForCausalLMLoss``: with ``shift`` the labels move left by one
    and the last position of each sequence is ignored; ``shift_labels`` is used as given;
    the loss is the mean over non-ignored tokens, or their sum divided by
    ``num_items_in_batch`` (gradient accumulation). A batch whose tokens are all ignored
    gives NaN (0/0), as there, and zero gradients. Log-sum-exp, the loss and the head's
    weight gradient accumulate in fp32 (fp64 for fp64 inputs); the head's matmuls run in
    the input dtype (or the autocast dtype). A head that does not require grad gets no
    weight gradient computed; a head tied to the input embedding gets its share added by
    autograd as usual.

    Args:
        hidden_states: ``[..., H]`` (e.g. ``[B, S, H]``), the head's input.
        head_weight: ``[V, H]``; head_bias: ``[V]`` or None.
        labels: ``[...]`` token ids (``[B, S]``); ignored when ``shift_labels`` is given.
        num_chunks / chunk_tokens: how to split the tokens (None: automatic, ``2**28 // V``
            tokens per chunk, so 1 GiB of fp32 logits at most).
        ignore_index: label value excluded from the loss.
        num_items_in_batch: divide the summed loss by this instead of taking the mean.
        shift: shift ``labels`` left by one along the last dimension.
        shift_labels: labels already aligned with ``hidden_states``.
        logit_scale: multiply the logits by this (Cohere's ``logit_scale``; Granite's
            ``1 / logits_scaling``).
        final_logit_softcapping: ``c * tanh(logits / c)`` after scaling (Gemma 2).

    Returns:
        The scalar loss (fp32, or fp64 for fp64 inputs).

    Example:
        >>> hidden = model.model(input_ids).last_hidden_state
        >>> loss = chunked_cross_entropy(hidden, model.lm_head.weight, input_ids)
        >>> loss.backward()
    """
    if head_weight.dim() != 2 or hidden_states.shape[-1] != head_weight.shape[1]:
        raise ValueError(
            f"head_weight {tuple(head_weight.shape)} does not match hidden_states "
            f"{tuple(hidden_states.shape)}; expected [vocab, {hidden_states.shape[-1]}]"
        )
    if not head_weight.is_floating_point():
        raise ValueError(f"head_weight has dtype {head_weight.dtype}; a quantized head cannot be used here")
    if shift_labels is None:
        if labels is None:
            raise ValueError("pass labels (or shift_labels)")
        if shift:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        else:
            shift_labels = labels
    if shift_labels.numel() != hidden_states.numel() // hidden_states.shape[-1]:
        raise ValueError(
            f"labels {tuple(shift_labels.shape)} do not match hidden_states "
            f"{tuple(hidden_states.shape)} (one label per position)"
        )
    vocab = head_weight.shape[0]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    labels_flat = shift_labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
    valid = labels_flat != ignore_index
    out_of_range = valid & ((labels_flat < 0) | (labels_flat >= vocab))
    if bool(out_of_range.any()):
        # As torch's cross-entropy: a label that is neither a class nor ignore_index is an error,
        # not a token silently counted in the mean and left out of the sum.
        bad = int(labels_flat[out_of_range][0])
        raise IndexError(
            f"Target {bad} is out of bounds: labels must be in [0, {vocab}) or ignore_index={ignore_index}"
        )
    # -1 marks ignored tokens inside the kernel loop, whatever ignore_index is.
    labels_flat = torch.where(valid, labels_flat, -1)
    compute_dtype = _compute_dtype(hidden, head_weight)
    acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    denom: torch.Tensor | int | float
    if num_items_in_batch is None:
        denom = valid.sum()
    elif torch.is_tensor(num_items_in_batch):
        denom = num_items_in_batch.to(hidden.device)
    else:
        denom = num_items_in_batch
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and hidden.requires_grad
    need_w = grad_on and head_weight.requires_grad
    need_b = grad_on and head_bias is not None and head_bias.requires_grad
    if need_h or need_w or need_b:
        inv = 1.0 / (
            denom.to(acc_dtype)
            if torch.is_tensor(denom)
            else torch.tensor(float(denom), dtype=acc_dtype, device=hidden.device)
        )
        token_weight = torch.where(valid, inv, torch.zeros((), dtype=acc_dtype, device=hidden.device))
    else:
        token_weight = valid
    chunk = _chunk_tokens(hidden.shape[0], vocab, num_chunks, chunk_tokens)
    scale = 1.0 if logit_scale is None else float(logit_scale)
    softcap = None if final_logit_softcapping is None else float(final_logit_softcapping)
    opts = (chunk, scale, softcap, need_h, need_w, need_b, compute_dtype)
    return _ChunkedCrossEntropy.apply(hidden, head_weight, head_bias, labels_flat, token_weight, denom, opts)
