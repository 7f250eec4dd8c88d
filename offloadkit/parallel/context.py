"""Context parallelism: one sequence split across the ranks of a process group, for Hugging
Face causal LMs, combined with everything else offloadkit does to a step.

Each rank holds ``S / W`` tokens of every row: chunk ``r`` and chunk ``2W - 1 - r`` of ``2W``
equal chunks, so that causal attention costs every rank the same. Everything token-wise (the
embeddings, norms, MLPs, the chunked loss, checkpointing and its offloaded block inputs)
runs on the local tokens as it would on a shorter sequence. Attention is the one place
ranks meet:

- on CUDA, PyTorch's own context-parallel attention (ring attention over
  ``torch.distributed``, flash or cuDNN kernels in 16-bit) through its public
  ``context_parallel`` context;
- elsewhere (CPU), keys and values are all-gathered over the group and attention masks by
  global positions, which computes the same function with more memory.

The model's attention is switched to offloadkit's attention function by name (Hugging Face's
``AttentionInterface``), which asks for no mask: Hugging Face then neither builds an
``S x S`` mask nor reads position ids back to the host. Labels are shifted before the
sequence is split, and the loss is normalised by the token count of the whole sequence, so
the ranks' losses and gradients add up to the single-process ones.

Example::

    cp = apply_context_parallel(model, mesh)            # mesh: 1-D DeviceMesh of the group
    for batch in loader:                                  # every rank of a group: the same batch
        with cp.step(batch["input_ids"], batch["labels"]) as inputs:
            loss = model(**inputs).loss
            loss.backward()                               # inside: attention's backward is distributed
        cp.reduce_gradients()                             # or FSDP2 over the group, see the README
        opt.step(); opt.zero_grad()                       # BackwardAdamW: cp.attach_optimizer(opt) once
    cp.remove()
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from offloadkit.models.heads import unwrap_model

__all__ = ["ATTENTION", "ContextParallel", "apply_context_parallel", "head_tail_order"]

ATTENTION = "offloadkit_context_parallel"
_INSTALL_HINT = "context parallelism needs transformers: pip install 'offloadkit[hf]'"


def head_tail_order(seq_len: int, world: int, rank: int, device=None) -> torch.Tensor:
    """Token indices rank ``rank`` holds: chunk ``rank`` then chunk ``2 * world - 1 - rank``."""
    chunk = seq_len // (2 * world)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk, device=device)
    return torch.cat([first, second])


@dataclass
class _Step:
    cp: "ContextParallel"
    positions: torch.Tensor  # [B, S_local] global positions of this rank's tokens
    all_positions: torch.Tensor | None = None  # [B, S] in gather order (the all-gather path)


_active: _Step | None = None  # the step whose sharded sequence the attention function serves


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence dim; backward sums the gradient over the ranks and keeps
    this rank's part (an all-reduce: every backend has one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, world: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, rank, x.shape[2]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(2, ctx.rank * ctx.size, ctx.size), None, None, None


def _repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _gathered_attention(step: _Step, q, k, v, scale):
    cp = step.cp
    k_all = _GatherSeq.apply(k, cp.group, cp.rank, cp.world)
    v_all = _GatherSeq.apply(v, cp.group, cp.rank, cp.world)
    groups = q.shape[1] // k.shape[1]
    allowed = step.all_positions[:, None, None, :] <= step.positions[:, None, :, None]
    return F.scaled_dot_product_attention(
        q, _repeat_heads(k_all, groups), _repeat_heads(v_all, groups), attn_mask=allowed, scale=scale
    )


def _ring_attention(q, k, v, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = q.shape[1] // k.shape[1]
    if q.dtype in (torch.bfloat16, torch.float16):
        # 16-bit: the flash and cuDNN kernels handle grouped keys; ring attention's memory-
        # efficient path gives wrong query/key gradients in 16-bit (seen on torch 2.11).
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(
            q, _repeat_heads(k, groups), _repeat_heads(v, groups), is_causal=True, scale=scale
        )


def context_parallel_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """The attention function a model switched by :func:`apply_context_parallel` runs:
    Hugging Face's signature, ``[B, H, S_local, D]`` in, ``[B, S_local, H, D]`` out."""
    step = _active
    if step is None:
        raise RuntimeError(
            "offloadkit: this model's attention is context-parallel; run its forward and backward "
            "inside `with cp.step(input_ids, labels) as inputs:` (or cp.remove() to undo)"
        )
    if attention_mask is not None:
        raise ValueError(
            "offloadkit: context parallelism attends causally over the whole sequence and takes no "
            "attention mask; pad at the end with labels -100 instead of masking"
        )
    if dropout:
        raise ValueError(
            f"offloadkit: attention dropout {dropout} is not supported with context parallelism; "
            "set the model's attention_dropout to 0"
        )
    # What Hugging Face passes for attention that is not plain causal attention over the whole
    # sequence (sliding windows, logit soft-capping, attention sinks, packed documents).
    for name in ("sliding_window", "softcap", "s_aux", "cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"offloadkit: context parallelism computes full causal attention; this layer asks "
                f"for {name}={kwargs[name]!r}"
            )
    if getattr(module, "is_causal", True) is False:
        raise ValueError("offloadkit: context parallelism computes causal attention; this layer is not causal")
    if query.is_cuda:
        out = _ring_attention(query, key, value, scaling)
    else:
        out = _gathered_attention(step, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


class ContextParallel:
    """What :func:`apply_context_parallel` attached; ``remove()`` restores the model.

    Attributes:
        mesh / group: the 1-D device mesh and its process group.
        rank / world: this rank's place in the group.
    """

    def __init__(self, model: nn.Module, mesh, previous_attention: str) -> None:
        self.model = model
        self.mesh = mesh
        self.group = mesh.get_group()
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._previous = previous_attention
        self._removed = False
        self._reduced_by_optimizer: set[int] = set()

    @contextlib.contextmanager
    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, dp_group=None):
        """Split one batch over the group for a forward and backward run inside.

        Args:
            input_ids: ``[B, S]``, the same on every rank of the group; ``S`` a multiple of
                ``2 * world``.
            labels: ``[B, S]`` (Hugging Face's unshifted labels, -100 ignored), or None.
            dp_group: data-parallel group whose ranks hold other batches: the loss is
                normalised by the token count summed over it.

        Yields:
            The model's keyword arguments: this rank's ``input_ids``, ``position_ids``,
            ``labels``/``shift_labels`` and ``num_items_in_batch`` (tokens with a label in the
            whole sequence), ``use_cache=False``. Pass no attention mask: rows are attended
            causally in full (pad at the end, labels -100). The labels are already shifted;
            the loss must honour ``shift_labels`` (Hugging Face's and offloadkit's chunked
            loss do). With ``dp_group`` and a data-parallel wrapper that averages gradients,
            scale the loss by the data-parallel size (the loss is normalised globally).
        """
        global _active
        if _active is not None:
            raise RuntimeError("offloadkit: cp.step() is already active; steps do not nest")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}")
        batch, seq = input_ids.shape
        if seq % (2 * self.world):
            raise ValueError(
                f"input_ids has {seq} tokens per row; context parallelism over {self.world} ranks needs a multiple "
                f"of {2 * self.world}: pad to {-(-seq // (2 * self.world)) * 2 * self.world} at the end (labels -100)"
            )
        device = input_ids.device
        positions = torch.arange(seq, device=device).expand(batch, seq).contiguous()
        buffers = [input_ids.clone(), positions]
        inputs: dict = {"use_cache": False}
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels {tuple(labels.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
            shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
            items = (shifted != -100).sum()
            if dp_group is not None:
                dist.all_reduce(items, group=dp_group)
            inputs["num_items_in_batch"] = items
            buffers.append(shifted)
        splitter: contextlib.AbstractContextManager
        if device.type == "cuda":
            from offloadkit.runtime.ring import ring_attention

            splitter = ring_attention(self.mesh, buffers, [1] * len(buffers))
        else:
            order = head_tail_order(seq, self.world, self.rank, device)
            buffers = [b.index_select(1, order) for b in buffers]
            splitter = contextlib.nullcontext()
        with splitter:
            inputs.update(input_ids=buffers[0], position_ids=buffers[1])
            if labels is not None:
                inputs.update(labels=buffers[2], shift_labels=buffers[2])
            step = _Step(self, buffers[1])
            if device.type != "cuda":
                # Every rank's positions, in the order the keys are gathered: known without asking.
                order = torch.cat([head_tail_order(seq, self.world, r, device) for r in range(self.world)])
                step.all_positions = order.expand(batch, seq)
            try:
                _active = step
                yield inputs
            finally:
                _active = None

    def attach_optimizer(self, optimizer) -> None:
        """Let an optimizer that updates in backward (``BackwardAdamW``, ``BackwardSGD``) sum
        each gradient over the group just before its update; :meth:`reduce_gradients` then
        leaves its parameters alone."""
        optimizer.reduce_over(self.group)
        self._reduced_by_optimizer.update(id(p) for g in optimizer.param_groups for p in g["params"])

    def reduce_gradients(self, params=None) -> None:
        """Sum every gradient over the group (each rank's is the part its tokens contribute).
        Not needed when FSDP2 shards over the group with a gradient divide factor of 1, nor
        for the parameters of an optimizer given to :meth:`attach_optimizer`."""
        for p in params if params is not None else self.model.parameters():
            if p.grad is not None and id(p) not in self._reduced_by_optimizer:
                dist.all_reduce(p.grad, group=self.group)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole sequence's loss (the sum of the ranks' parts), for logging."""
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def remove(self) -> None:
        """Give the model its previous attention back."""
        if not self._removed:
            unwrap_model(self.model).set_attn_implementation(self._previous)  # type: ignore[operator]
            self._removed = True


_UNSUPPORTED = (
    ("sliding_window", "sliding-window attention"),
    ("attention_chunk_size", "chunked attention"),
    ("attn_logit_softcapping", "soft-capped attention logits"),
)


def _check_config(config) -> None:
    for key, what in _UNSUPPORTED:
        if getattr(config, key, None) and (key != "sliding_window" or getattr(config, "use_sliding_window", True)):
            raise ValueError(
                f"context parallelism computes full causal attention; this model uses {what} "
                f"({key}={getattr(config, key)!r})"
            )
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"context parallelism computes full causal attention; this model's layers are {set(layer_types)}"
        )


def apply_context_parallel(model: nn.Module, mesh=None, *, rotation: str = "allgather") -> ContextParallel:
    """Run ``model``'s attention across the ranks of ``mesh``, one sequence split between them.

    Args:
        model: a Hugging Face causal LM (PEFT and DDP/FSDP wrappers are looked through) whose
            attention goes through ``AttentionInterface`` (Llama, Mistral, Qwen2, ...), with full
            causal attention in every layer.
        mesh: a 1-D ``DeviceMesh`` of the ranks sharing each sequence (default: all ranks).
        rotation: how ring attention moves keys and values on CUDA: ``"allgather"``,
            ``"alltoall"`` (less memory) or ``"auto"`` (allgather; a plan's
            ``context_parallel_rotation`` says which it counted). Process-wide.

    Returns:
        A :class:`ContextParallel`; run each step in ``with cp.step(input_ids, labels) as inputs:``.

    Raises:
        ValueError: no process group, a model that cannot switch attention, or attention that
            is not full causal attention.
    """
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    from offloadkit.runtime.ring import ROTATIONS, set_rotation

    if rotation == "auto":
        rotation = "allgather"  # no plan chose one here: torch's own default
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r} is invalid; choose one of {', '.join(ROTATIONS)} or auto")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "context parallelism needs a process group: launch with torchrun and call "
            "torch.distributed.init_process_group() first"
        )
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("cp",))
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be 1-D (the context-parallel dimension); got {mesh.ndim} dimensions: pass mesh['cp']"
        )
    base = unwrap_model(model)
    config = getattr(base, "config", None)
    switch = getattr(base, "set_attn_implementation", None)
    if config is None or switch is None:
        raise ValueError(f"{type(base).__name__} is not a Hugging Face model whose attention can be switched")
    _check_config(config)
    AttentionInterface.register(ATTENTION, context_parallel_attention)
    previous = config._attn_implementation or "sdpa"
    switch(ATTENTION)
    if config._attn_implementation != ATTENTION:
        raise ValueError(
            f"{type(base).__name__} did not take another attention implementation "
            f"(still {config._attn_implementation!r}); context parallelism needs one that does"
        )
    if torch.cuda.is_available():
        set_rotation(rotation)
    return ContextParallel(model, mesh, previous)
