"""Every rank's batch in turn, each split over all the ranks: context parallelism for a
training loop whose data loader gives each rank its own batches (the Trainer's).

A step then trains on exactly the sequences it would without context parallelism: turn ``r``
broadcasts rank ``r``'s batch, every rank runs forward and backward on its share of it, and the
gradients of all turns add up on each rank before the data-parallel reduction (DDP, FSDP2)
averages them. Each rank holds ``1/world`` of every sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["batches_in_turn", "count_label_tokens", "right_padded_labels"]


def count_label_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens whose next-token label counts (Hugging Face's shift: the last position has none)."""
    return (labels[:, 1:] != -100).sum()


def right_padded_labels(labels, attention_mask) -> torch.Tensor:
    """``labels`` with every padded position ignored; refuses padding before a token (ring
    attention attends causally over whole rows, so padding must come last)."""
    if labels is None:
        raise ValueError("context parallelism needs labels in the batch (the loss is computed inside the model)")
    if attention_mask is None:
        return labels
    mask = attention_mask.bool()
    # Right padding: once a row's mask is 0 it stays 0.
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError(
            "context parallelism attends causally over whole rows: pad on the right (tokenizer.padding_side = "
            "'right'), not the left"
        )
    return labels.masked_fill(~mask, -100)


def _check_positions(position_ids) -> None:
    if position_ids is None:
        return
    expected = torch.arange(position_ids.shape[-1], device=position_ids.device)
    if not bool((position_ids == expected).all()):
        raise ValueError(
            "context parallelism runs each row as one causal sequence: packed documents (position ids that "
            "restart) are not supported; turn sample packing off"
        )


def batches_in_turn(group, input_ids: torch.Tensor, labels, attention_mask=None, position_ids=None):
    """Yield ``(turn, input_ids, labels)`` for each rank's batch in rank order, broadcast from that
    rank over ``group`` and right-padded (labels -100) to a multiple of ``2 * world`` tokens.

    Raises:
        ValueError: no labels, left padding, or packed documents.
    """
    labels = right_padded_labels(labels, attention_mask)
    _check_positions(position_ids)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    shape = torch.tensor(list(input_ids.shape), device=input_ids.device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    multiple = 2 * world
    for turn, (rows, length) in enumerate(s.tolist() for s in shapes):
        padded = -(-length // multiple) * multiple
        if turn == rank:
            ids = F.pad(input_ids, (0, padded - length), value=0).contiguous()
            lab = F.pad(labels, (0, padded - length), value=-100).contiguous()
        else:
            ids = torch.empty((rows, padded), dtype=input_ids.dtype, device=input_ids.device)
            lab = torch.empty((rows, padded), dtype=labels.dtype, device=labels.device)
        source = dist.get_global_rank(group, turn)
        dist.broadcast(ids, source, group=group)
        dist.broadcast(lab, source, group=group)
        yield turn, ids, lab
