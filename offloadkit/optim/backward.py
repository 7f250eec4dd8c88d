"""What every optimizer that updates in backward shares: a hook per parameter that runs its
update as soon as its gradient is complete, the state in (pinned) host memory and its trips to
the GPU (:mod:`.state_copies`), and the rules for when the update waits.

When it waits: gradient clipping by global norm needs every gradient before any update, so
with ``max_grad_norm`` the updates are deferred to :meth:`BackwardOptimizer.step`, which clips
exactly as ``torch.nn.utils.clip_grad_norm_`` and then updates parameter by parameter (the
gradients are held until then). Inside ``with optimizer.accumulating():`` backward only
accumulates; the update happens in the backward after it. With a loss scaler (fp16) or a
Trainer that clips between backward and ``step()``, ``defer_to_step=True``.

A gradient that comes in pieces waits too. Reentrant checkpointing (``use_reentrant=True``)
recomputes each segment in backward and runs a backward of its own through it, so a parameter
used in two segments has its hook called once per segment, the first time with part of its
gradient. A hook called inside such a nested backward leaves the gradient to accumulate, and
:meth:`~BackwardOptimizer.step` updates the parameter once, with the whole gradient (held
until then). Everywhere else a parameter's uses meet in one accumulation before its hook runs
(tied weights included), so it is updated in backward. A parameter updated in backward before
a nested backward adds to its gradient (used inside and outside reentrant checkpoints) is an
error: non-reentrant checkpointing updates every parameter in backward. FSDP2 calls its
shards' hooks from an autograd Function's backward too, but from its reduction, with the
module's reduce-scattered gradient: shards are updated there. A module that runs twice in one
forward is reduced once per call; a shard reduced twice in one backward is an error.

Where the state rests: pinned host memory by default. With ``state_dir`` each state tensor is
a file in that directory mapped into memory (the file is unlinked at once, so nothing is left
behind): the OS keeps in RAM what fits and pages the rest to disk, for hosts whose RAM cannot
hold the state. Such memory is not page-locked, so its copies to and from the GPU wait for
the host.

A subclass says what state a parameter has (:meth:`_init_state`, :data:`STATE_KEYS`) and how
one parameter is updated from it (:meth:`_apply`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version
from torch.optim import Optimizer

from offloadkit.defaults import STATE_GROUPS_AHEAD
from offloadkit.layers.flat import order_after_write_back
from offloadkit.optim.reduction import DDPUpdates, is_shard, local_tensor, ranks_in_run, unreduced_error
from offloadkit.optim.state_copies import StateCopies
from offloadkit.runtime.autograd import current_graph_task, in_fsdp_reduce, in_function_backward
from offloadkit.transfer.prefetch import PrefetchScheduler

__all__ = ["BackwardOptimizer"]


class BackwardOptimizer(Optimizer):
    """Base of the optimizers that update each parameter in backward.

    Args:
        params, defaults: as for ``torch.optim.Optimizer``.
        max_grad_norm: clip gradients by their global norm first (updates then wait for
            :meth:`step`); None: update in backward.
        pin_memory: page-lock the host state of CUDA parameters (asynchronous copies).
        update_when: asked in backward before updating; False leaves the gradient to
            accumulate (the Trainer passes whether this micro-step synchronizes gradients).
        defer_to_step: update only in :meth:`step`.
        copy_window_bytes: GPU memory for state fetched ahead, and for state still being
            copied back, each.
        state_dir: keep the state in memory-mapped files in this directory (created if
            missing) instead of pinned memory; None: pinned host memory.
        scheduler: the :class:`~offloadkit.transfer.PrefetchScheduler` whose window the
            state's look-ahead runs in, shared with activations and streamed weights
            (``runtime.scheduler`` of :func:`~offloadkit.prepare`); None: one of its own.
    """

    # A parameter's host-resident state tensors that travel to the GPU for its update.
    STATE_KEYS: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable,
        defaults: dict,
        *,
        max_grad_norm: float | None,
        pin_memory: bool,
        update_when: Callable[[], bool] | None,
        defer_to_step: bool,
        copy_window_bytes: int,
        state_dir: str | None = None,
        scheduler: PrefetchScheduler | None = None,
    ) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} is invalid; pass a positive norm or None")
        if state_dir is not None:
            try:
                os.makedirs(state_dir, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"state_dir={state_dir!r} cannot hold the optimizer's state: {exc}") from exc
        self.state_dir = state_dir
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.pin_memory = pin_memory
        self.update_when = update_when
        self.defer_to_step = defer_to_step
        self._accumulating = False
        self._updated: set[int] = set()  # parameters updated in backward since the last step()
        self._copies = StateCopies(self._travelling, copy_window_bytes, scheduler)
        self._groups_seen: tuple[int, dict[int, dict]] = (0, {})
        self._handles: list | None = None  # the hooks while attached
        self._hooked_ids: list[int] = []  # the parameters they are on
        # How gradients are reduced over ranks before an update: "unsaid" (refused under
        # several ranks), "local" (complete on every rank), "ddp" (a DDP hook updates), or a
        # process group to all-reduce each gradient over.
        self._reduction: Any = "unsaid"
        self._ddp: DDPUpdates | None = None
        self._ddp_model: weakref.ref | None = None
        self._waits_for_ddp = False  # DDP with find_unused_parameters: updates at step()
        self._reduced: set[int] = set()  # gradients all-reduced over the group this pass
        self._fsdp_updated: dict[int, int | None] = {}  # shard -> the backward FSDP2 updated it in
        self.attach()

    # -- what a subclass provides ---------------------------------------------------------
    def _init_state(self, p: torch.Tensor, group: dict, state: dict) -> None:
        """Fill ``p``'s empty ``state`` (host tensors, pinned when ``_pin(p)``)."""
        raise NotImplementedError

    def _apply(
        self, p: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, local: dict, state: dict, group: dict
    ) -> None:
        """Update ``weight`` (``p`` itself, or its local shard) from ``grad``; ``p`` keys the
        state. ``local`` holds the travelling state where the update runs (device copies for a
        CUDA parameter), ``state`` the host-side entry."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------
    def _pin(self, p: torch.Tensor) -> bool:
        return self.pin_memory and p.is_cuda and self.state_dir is None

    def _host_zeros(self, p: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled host tensor for ``p``'s state: pinned, or a mapped file in ``state_dir``."""
        if self.state_dir is None:
            return torch.zeros(shape, dtype=dtype, pin_memory=self._pin(p))
        numel = max(1, int(torch.Size(shape).numel()))
        # A name no other process or optimizer holds (ranks may share the directory), and the
        # space reserved now: a full disk is an error here, not a SIGBUS at the first write.
        fd, path = tempfile.mkstemp(prefix="offloadkit-state-", suffix=".bin", dir=self.state_dir)
        try:
            os.posix_fallocate(fd, 0, numel * torch.empty((), dtype=dtype).element_size())
            mapped = torch.from_file(path, shared=True, size=numel, dtype=dtype)  # reads as zeros
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping outlives its name
        return mapped[: torch.Size(shape).numel()].view(shape)

    def _group(self, p: torch.Tensor) -> dict:
        """``p``'s parameter group as it is now: ``load_state_dict`` (Accelerate's device
        placement calls it) replaces the group dicts that schedulers then change."""
        seen, by_param = self._groups_seen
        if seen != id(self.param_groups) or id(p) not in by_param:
            by_param = {id(q): group for group in self.param_groups for q in group["params"]}
            self._groups_seen = (id(self.param_groups), by_param)
        return by_param[id(p)]

    def _host_state(self, p: torch.Tensor, weight: torch.Tensor) -> dict:
        state = self.state.get(p)
        if not state:
            # Kept only once it holds something (SGD without momentum keeps nothing, as torch's).
            state = {}
            self._init_state(weight, self._group(p), state)
            if state:
                self.state[p] = state
        return state

    def _travelling(self, p: torch.Tensor):
        """``p``'s host state and the keys of its tensors that visit the GPU (None: none)."""
        state = self.state.get(p)
        if not state:
            return None
        keys = tuple(k for k in self.STATE_KEYS if k in state)
        return (state, keys) if keys else None

    @torch.no_grad()
    def _update(self, p: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Update ``p`` from ``grad`` (default: its ``.grad``) and drop its ``.grad``. An FSDP2
        parameter is updated through its local shard, its state the shard's size."""
        grad = local_tensor(p.grad if grad is None else grad)
        weight = local_tensor(p)
        if grad.device != weight.device:
            # An evicted streamed weight resting in a file (layer_offloading_dir) has no device
            # mapping for an update after backward to write through.
            raise RuntimeError(
                f"offloadkit: a {list(p.shape)} weight rests in a file while its block is evicted, and its update "
                "was deferred until after backward (clipping, fp16 loss scaling): weights in files are updated in "
                "backward only. Turn clipping off (max_grad_norm: 0), or give host_budget_bytes room for the "
                "trainable weights so they stay in pinned RAM"
            )
        group = self._group(p)
        state = self._host_state(p, weight)
        travels = weight.is_cuda and self._travelling(p) is not None
        if travels:
            # In on the copy stream (fetched ahead when the order is known), updated here,
            # back on the other copy stream while backward goes on.
            local = self._copies.fetch(p)
        else:
            local = {k: state[k] for k in self.STATE_KEYS if k in state}
        # A streamed weight being written where it rests waits for its block's write-back.
        order_after_write_back(p)
        # The fused kernels write the parameter without moving its version counter; streamed
        # layers read that counter to know the weights changed and must be written back.
        increment_version(weight)
        self._apply(p, weight, grad, local, state, group)
        if state and p not in self.state:
            self.state[p] = state  # created by the update itself (SGD's momentum buffer)
        if travels:
            self._copies.store(p, local)
        p.grad = None  # its memory goes back now, not at zero_grad()

    @property
    def updates_in_backward(self) -> bool:
        """Whether parameters are updated in backward (no clipping to wait for)."""
        return self.max_grad_norm is None and not self.defer_to_step and not self._waits_for_ddp

    def updates_now(self) -> bool:
        """Whether a gradient completed now is applied now (attached, updating in backward,
        not accumulating, and the trainer's ``update_when`` agrees)."""
        if not self.attached or not self.updates_in_backward or self._accumulating:
            return False
        return self.update_when is None or bool(self.update_when())

    # -- reduction over ranks (see optim/reduction.py) -----------------------------------------
    def reduce_with_ddp(self, ddp_model, hook: Callable | None = None, state: Any = None) -> None:
        """Update the parameters of ``ddp_model`` (a ``DistributedDataParallel``) after DDP's
        all-reduce, from the reduced gradients, through a communication hook registered on it.

        Call before the first backward (again for a new wrapper; nothing for the same one).
        DDP takes one communication hook: to keep one of
        your own (e.g. ``bf16_compress_hook``), pass it and its state here instead of
        registering it. With ``find_unused_parameters=True`` the updates wait for
        :meth:`step` (a bucket cannot tell which of its parameters no rank used). With
        ``gradient_as_bucket_view=True`` DDP keeps no gradients besides its buckets.
        """
        if self._ddp_model is not None and self._ddp_model() is ddp_model:
            return  # already routed (a Trainer's second train() on the same wrapper)
        shared = {id(p) for g in self.param_groups for p in g["params"]} & {id(p) for p in ddp_model.parameters()}
        if not shared:
            raise ValueError("ddp_model holds none of this optimizer's parameters; pass the model it updates")
        self._reduction = "ddp"
        self._ddp_model = weakref.ref(ddp_model)
        self._ddp = None
        self._waits_for_ddp = bool(getattr(ddp_model, "find_unused_parameters", False))
        if self._waits_for_ddp:
            warnings.warn(
                "offloadkit: DDP with find_unused_parameters=True: the optimizer updates at step(), after DDP's "
                "all-reduce, keeping every gradient until then; pass find_unused_parameters=False (Trainer: "
                "ddp_find_unused_parameters=False) to update each parameter in backward",
                UserWarning,
                stacklevel=2,
            )
            return
        self._ddp = DDPUpdates(self, ddp_model, shared, hook, state)
        ddp_model.register_comm_hook(None, self._ddp)

    def reduce_over(self, group) -> None:
        """All-reduce (sum) each gradient over ``group`` before its update, in backward or at
        :meth:`step` (context parallelism: every rank holds part of every gradient). ``None``:
        each rank's gradients are complete, nothing is reduced."""
        self._reduction = "local" if group is None else group

    def _reduce(self, p: torch.Tensor) -> None:
        """All-reduce ``p``'s gradient over the group given to :meth:`reduce_over`, once a pass."""
        group = self._reduction
        if group in ("unsaid", "local", "ddp") or id(p) in self._reduced:
            return
        dist.all_reduce(p.grad, group=group)
        self._reduced.add(id(p))

    def _update_reduced(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Update ``p`` from its reduced gradient ``grad`` (DDP's bucket view)."""
        if self._ddp is None or id(p) not in self._ddp.params or id(p) in self._updated:
            return  # another optimizer's (or frozen), or already updated this pass
        self._updated.add(id(p))
        self._update(p, grad)

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._ddp is not None and id(p) in self._ddp.params:
            return  # DDP reduces it after this hook; its communication hook updates
        if not self.updates_now():
            return  # clipping needs every gradient first, or accumulating: step() updates
        # FSDP2 runs a shard's hooks itself, from its post-backward Function, once the
        # reduce-scatter has made its module's gradient: not a reentrant segment's part.
        # A stack walk per hook: only a shard can be FSDP2's.
        if is_shard(p) and in_fsdp_reduce():
            task = current_graph_task()
            if self._fsdp_updated.get(id(p)) == task:
                raise RuntimeError(
                    f"offloadkit: FSDP2 reduced a {list(p.shape)} shard's gradient twice in one backward (its module "
                    "ran more than once in forward, each call's part reduced apart) after it was updated from the "
                    "first part; pass defer_to_step=True to update at step() from the whole gradient"
                )
            self._fsdp_updated[id(p)] = task
        elif in_function_backward():
            if id(p) in self._updated:
                raise RuntimeError(
                    f"offloadkit: a {list(p.shape)} parameter was updated in backward, then got more gradient from "
                    "a reentrant checkpoint's backward (it is used inside and outside reentrantly checkpointed code); "
                    "checkpoint with use_reentrant=False, or pass defer_to_step=True to update at step()"
                )
            return  # another segment may add to this gradient: step() updates with the whole
        if self._reduction == "unsaid" and not is_shard(p):
            ranks = ranks_in_run()
            if ranks > 1:
                raise unreduced_error(list(p.shape), ranks)
        self._reduce(p)
        self._updated.add(id(p))
        self._update(p)

    # -- the Optimizer interface -------------------------------------------------------------
    @contextlib.contextmanager
    def accumulating(self):
        """Backward passes inside only accumulate gradients (gradient accumulation)."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield self
        finally:
            self._accumulating = previous

    @torch.no_grad()
    def step(self, closure=None):
        """Update the parameters whose gradients are still waiting (clipping first when
        ``max_grad_norm`` is set, or pieced together in reentrant checkpoints); those updated
        in backward have none left."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        waiting = []
        for p in (p for g in self.param_groups for p in g["params"]):
            if p.grad is None:
                continue
            if id(p) in self._updated:
                p.grad = None  # updated in backward; DDP wrote its reduced gradient back after
            else:
                waiting.append(p)
        for p in waiting:
            self._reduce(p)  # every rank reaches these in the groups' order
        if waiting and self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(waiting, self.max_grad_norm)
        for p in waiting:
            self._update(p)
        self._updated.clear()
        self._reduced.clear()
        self._fsdp_updated.clear()
        self._copies.end_pass()
        self.follow_parameters()  # replaced since the last pass: the next backward updates them
        return loss

    def _synchronize(self) -> None:
        """Host reads and writes of the state wait for its copies to and from the device."""
        if any(p.is_cuda for g in self.param_groups for p in g["params"]):
            torch.cuda.synchronize()
        self._copies.wait_all()

    def state_dict(self):
        self._synchronize()
        return super().state_dict()

    def _load_groups(self, state_dict, keep: tuple[str, ...] = ()) -> list[tuple[torch.Tensor, dict | None]]:
        """Load a checkpoint's parameter groups (keeping this optimizer's ``keep`` keys) and
        return each parameter with its saved state, for the subclass to place on the host.

        PyTorch's loader would first move every state tensor next to its parameter (the whole
        state on the GPU at once); here only the groups go through it.
        """
        self._synchronize()  # no copy may still write the state being replaced
        self._copies.reset()
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        ours = [p for g in self.param_groups for p in g["params"]]
        asked = [{k: g[k] for k in keep if k in g} for g in self.param_groups]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for group, mine in zip(self.param_groups, asked):
            group.update(mine)
            for key, value in self.defaults.items():
                group.setdefault(key, value)  # a torch.optim checkpoint lacks ours
        return [(p, state_dict["state"].get(i)) for i, p in zip(saved_ids, ours)]

    # -- the hooks' lifetime ------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        """Whether backward updates the parameters (between construction or :meth:`attach`
        and :meth:`remove`)."""
        return self._handles is not None

    def _hooked_now(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def attach(self) -> None:
        """Attach the backward hooks again after :meth:`remove`; nothing when attached."""
        if self._handles is None:
            params = self._hooked_now()
            self._hooked_ids = [id(p) for p in params]
            self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def follow_parameters(self) -> bool:
        """Hook the parameters the groups hold now where a wrapper has replaced them since
        the hooks were attached (Accelerate's FSDP2 preparation swaps an optimizer's
        parameters for the sharded ones made by ``fully_shard``: the old ones' hooks never
        fire, and every update would wait for :meth:`step` with the gradients held). Returns
        whether it attached them anew; :meth:`step` calls it, and so does the Trainer route
        at each training step."""
        if self._handles is None or [id(p) for p in self._hooked_now()] == self._hooked_ids:
            return False
        self.remove()
        self.attach()
        # The learned order and update groups name the replaced parameters: learn them again
        # (the Trainer route names the new groups).
        self._copies.reset()
        self._copies.set_groups([], 0)
        return True

    def remove(self) -> None:
        """Detach the backward hooks: a backward then leaves every gradient in place, and the
        optimizer updates only in :meth:`step`. Nothing when detached."""
        for handle in self._handles or ():
            handle.remove()
        self._handles = None

    def use_scheduler(self, scheduler: PrefetchScheduler | None) -> None:
        """Run the state's look-ahead in ``scheduler`` from now on (a new run's shared window);
        None: one of its own."""
        self._copies.use_scheduler(scheduler)

    def set_update_groups(self, groups: Iterable[Iterable[torch.Tensor]], ahead: int = STATE_GROUPS_AHEAD) -> None:
        """Fetch host-resident state ``ahead`` groups ahead (the rest of the group being updated
        counts as one), within ``copy_window_bytes``, where ``groups`` are the parameters updated
        together: each decoder layer's (the Trainer integration passes them). Without groups the
        look-ahead is the byte window alone, which at the first update of backward fetches as
        much state as it holds and makes the block inputs' prefetches share the link with it.

        Example:
            >>> opt.set_update_groups([list(layer.parameters()) for layer in model.model.layers])  # doctest: +SKIP
        """
        self._copies.set_groups(groups, ahead)
