"""The Trainer's training step under ``context_parallel: true``: every rank's batch in turn,
each split over all the ranks (:mod:`offloadkit.parallel.turns`).

The loss of a turn is the sum over this rank's tokens of that batch, normalised by the tokens
of every rank's batches (the Trainer's ``num_items_in_batch``, summed over the ranks when it is
a rank's own). The data-parallel wrapper averages gradients over the ranks, so each turn's
loss is scaled by the world size: the ranks' gradients add up to the whole step's. The
wrapper's reduction runs once, in the last turn's backward.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from offloadkit.parallel.context import ContextParallel
from offloadkit.parallel.turns import batches_in_turn, count_label_tokens, right_padded_labels

__all__ = ["training_step_in_turns"]

_TAKEN = {"input_ids", "labels", "attention_mask", "position_ids"}


def _step_tokens(trainer: Any, cp: ContextParallel, labels: torch.Tensor, num_items_in_batch) -> tuple[Any, float]:
    """(tokens the loss is normalised by, the loss's further scale)."""
    if num_items_in_batch is None:
        # The Trainer normalises by micro-batch then and divides by the accumulation steps.
        items = count_label_tokens(labels)
        dist.all_reduce(items, group=cp.group)
        return items, 1.0 / trainer.args.gradient_accumulation_steps
    items = torch.as_tensor(num_items_in_batch, device=labels.device).clone()
    if not getattr(trainer.args, "average_tokens_across_devices", False):
        dist.all_reduce(items, group=cp.group)  # a rank's own count: every rank's tokens count
    return items, 1.0


def training_step_in_turns(trainer: Any, cp: ContextParallel, model, inputs: dict, num_items_in_batch=None):
    """One training step of ``trainer`` with its batch and every other rank's, each split over
    the ranks. Returns the loss as the Trainer logs it (its mean over ranks is the step's)."""
    from offloadkit.integrations.optimizer import reduce_for_run

    others = sorted(k for k, v in inputs.items() if k not in _TAKEN and v is not None)
    if others:
        raise ValueError(
            f"context_parallel runs text batches (input_ids, labels, attention_mask); this batch also has {others}"
        )
    if getattr(trainer, "label_smoother", None) is not None:
        raise ValueError("context_parallel computes the model's own loss; turn label_smoothing_factor off")
    model.train()
    inputs = trainer._prepare_inputs(inputs)
    reduce_for_run(getattr(trainer, "optimizer", None), model)
    input_ids = inputs["input_ids"]
    labels = right_padded_labels(inputs.get("labels"), inputs.get("attention_mask"))
    items, scale = _step_tokens(trainer, cp, labels, num_items_in_batch)
    total = torch.zeros((), device=input_ids.device)
    runtime = trainer.offload_runtime
    for turn, turn_ids, turn_labels in batches_in_turn(cp.group, input_ids, labels, None, inputs.get("position_ids")):
        last = turn == cp.world - 1
        # The wrapper's reduction once, after the last turn has added its gradients.
        sync = contextlib.nullcontext() if last else trainer.accelerator.no_sync(model)
        with sync, cp.step(turn_ids, turn_labels) as step_inputs:
            step_inputs["num_items_in_batch"] = items
            with runtime.context():
                loss = model(**step_inputs).loss * (cp.world * scale)
            trainer.accelerator.backward(loss)
        total += loss.detach()
    return total
