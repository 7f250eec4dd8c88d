"""Where an update in backward meets data parallelism: the gradient it applies must be the one
reduced over the ranks, never a rank's own part.

Three routes, one per way gradients are reduced:

- **FSDP2** reduce-scatters a parameter's gradient and then runs the sharded parameter's
  post-accumulate-grad hooks: the hook already sees the reduced shard. Parameters are
  ``DTensor`` shards; updates run on their local tensors (:func:`local_tensor`).
- **DDP** all-reduces gradients in buckets after the accumulation hooks have run. A
  communication hook (:class:`DDPUpdates`) wraps DDP's all-reduce and updates each
  parameter of a bucket once its reduction is done, on a side stream so backward goes on.
- **A process group without a wrapper** (context parallelism: every rank holds part of every
  gradient): each gradient is all-reduced over the group just before its update.

A backward optimizer in a run of several ranks that was told none of these refuses its first
update in backward (:func:`unreduced_error`): updating with a rank's own gradient makes the
replicas drift apart without any other sign.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from offloadkit.runtime.dtensor import is_dtensor, local_tensor

if TYPE_CHECKING:
    from offloadkit.optim.backward import BackwardOptimizer

__all__ = ["DDPUpdates", "is_shard", "local_tensor", "ranks_in_run", "unreduced_error"]


def is_shard(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter or gradient)."""
    return is_dtensor(t)


def ranks_in_run() -> int:
    """Ranks of the default process group (1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def unreduced_error(shape: list, ranks: int) -> RuntimeError:
    return RuntimeError(
        f"offloadkit: a {shape} parameter would be updated in backward with this rank's own gradient, before it "
        f"is reduced over the {ranks} ranks (the replicas would drift apart). Say how gradients are reduced: "
        "opt.reduce_with_ddp(ddp_model) under DistributedDataParallel, cp.attach_optimizer(opt) under context "
        "parallelism, opt.reduce_over(group) for any other group, or opt.reduce_over(None) when every rank's "
        "gradients are already complete; FSDP2 (fully_shard) needs nothing"
    )


class DDPUpdates:
    """A DDP communication hook that runs DDP's all-reduce (or ``hook``) and then updates the
    bucket's parameters from the reduced gradients.

    On CUDA the updates run on a side stream that waits for the all-reduce; the future handed
    back to DDP completes on that stream, so DDP's end of backward (and everything after it)
    waits for the updates. DDP then writes the reduced gradients into ``.grad`` as usual;
    :meth:`BackwardOptimizer.step` drops those of updated parameters.
    """

    def __init__(
        self, optimizer: "BackwardOptimizer", ddp_model, params: set[int], hook: Callable | None, state: Any
    ) -> None:
        if hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            hook, state = allreduce_hook, ddp_model.process_group
        self._optimizer = weakref.ref(optimizer)
        self.model = weakref.ref(ddp_model)
        self.hook, self.state = hook, state
        self.params = params  # ids of the optimizer's parameters DDP reduces
        self.__name__ = self.__qualname__ = "offloadkit_update_after_all_reduce"  # DDP logs hooks by name

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return contextlib.nullcontext()
        from offloadkit.transfer.streams import update_stream

        # Bucket views are written on the compute stream; the all-reduce waits for them, and
        # this stream waits for the all-reduce below.
        return torch.cuda.stream(update_stream(device))

    # No return annotation: DDP checks it against the evaluated type, and this module's are strings.
    def __call__(self, _state: Any, bucket):  # -> torch.futures.Future[torch.Tensor]
        reduced = self.hook(self.state, bucket)
        optimizer = self._optimizer()
        if optimizer is None or not optimizer.updates_now():
            return reduced  # clipping, accumulation or detached: step() updates as usual
        buffer = bucket.buffer()
        with self._stream(buffer.device):
            reduced.wait()  # on CUDA: this stream waits for the all-reduce, the host does not
            for p, grad in zip(bucket.parameters(), bucket.gradients()):
                optimizer._update_reduced(p, grad)
            done: torch.futures.Future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
            done.set_result(buffer)  # completes once this stream's updates have run
        return done
