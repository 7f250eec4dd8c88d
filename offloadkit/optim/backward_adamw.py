"""AdamW that updates each parameter during backward, as soon as its gradient is complete,
with its moments kept in (pinned) host memory.

Two things leave the GPU: the optimizer state (two moments per parameter, 4 or 8 bytes each
in fp32) lives on the host and visits the GPU only for its parameter's update, and no
gradient outlives its update, so the model never holds a full set of gradients. For a full
fine-tune that is what a GPU holds beyond the weights: an 8B model in bf16 needs 16 GB of
gradients and 32-64 GB of AdamW state.

The update is PyTorch's own single-tensor AdamW (``torch.optim.adamw.adamw`` with
``foreach=False``), step for step, so the result is bitwise the one ``torch.optim.AdamW``
gives on the same gradients (same parameter dtype, same state dtype: the moments have the
parameter's dtype, as in PyTorch).

Gradient clipping by global norm needs every gradient before any update: with
``max_grad_norm`` the updates are deferred to :meth:`step` (the gradients are then held
until the end of backward, as without this optimizer), which clips exactly as
``torch.nn.utils.clip_grad_norm_`` and then updates parameter by parameter. Gradient
accumulation: inside ``with optimizer.accumulating():`` backward only accumulates; the
update happens in the backward after it (or at :meth:`step` when deferred).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
from torch.optim import Optimizer
from torch.optim.adamw import adamw

__all__ = ["BackwardAdamW"]


class BackwardAdamW(Optimizer):
    """AdamW updating in backward with host-resident moments.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW``.
        max_grad_norm: clip gradients by their global norm first (updates then wait for
            :meth:`step`); None: update in backward.
        pin_memory: page-lock the host state of CUDA parameters (asynchronous copies).
        update_when: asked in backward before updating; False leaves the gradient to
            accumulate (the Trainer passes whether this micro-step synchronizes gradients).
        defer_to_step: update only in :meth:`step` (someone else clips the gradients in
            between, as the Trainer does).

    Example:
        >>> opt = BackwardAdamW(model.parameters(), lr=1e-5)  # doctest: +SKIP
        >>> loss = model(**batch).loss; loss.backward()          # parameters updated here
        >>> opt.step(); opt.zero_grad()                          # bookkeeping only
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = None,
        pin_memory: bool = True,
        update_when: Callable[[], bool] | None = None,
        defer_to_step: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr={lr!r} is invalid; it must be >= 0")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} is invalid; pass a positive norm or None")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.pin_memory = pin_memory
        self.update_when = update_when
        self.defer_to_step = defer_to_step
        self._accumulating = False
        self._groups_seen: tuple[int, dict[int, dict]] = (0, {})
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad
        ]

    def _group(self, p: torch.Tensor) -> dict:
        """``p``'s parameter group as it is now: ``load_state_dict`` (Accelerate's device
        placement calls it) replaces the group dicts that schedulers then change."""
        seen, by_param = self._groups_seen
        if seen != id(self.param_groups) or id(p) not in by_param:
            by_param = {id(q): group for group in self.param_groups for q in group["params"]}
            self._groups_seen = (id(self.param_groups), by_param)
        return by_param[id(p)]

    # -- the update --------------------------------------------------------------------
    def _host_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            pin = self.pin_memory and p.is_cuda
            # The moments have the parameter's dtype, as torch.optim.AdamW keeps them.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros(p.shape, dtype=p.dtype, pin_memory=pin)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=p.dtype, pin_memory=pin)
        return state

    @torch.no_grad()
    def _update(self, p: torch.Tensor) -> None:
        group = self._group(p)
        state = self._host_state(p)
        # To the device on the current stream; the copy back below is queued on the same
        # stream, so the next update's read of the host state is ordered after it.
        exp_avg = state["exp_avg"].to(p.device, non_blocking=True)
        exp_avg_sq = state["exp_avg_sq"].to(p.device, non_blocking=True)
        beta1, beta2 = group["betas"]
        adamw(
            [p],
            [p.grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [state["step"]],
            foreach=False,
            capturable=False,
            differentiable=False,
            fused=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        if exp_avg is not state["exp_avg"]:
            state["exp_avg"].copy_(exp_avg, non_blocking=True)
            state["exp_avg_sq"].copy_(exp_avg_sq, non_blocking=True)
        p.grad = None  # its memory goes back now, not at zero_grad()

    @property
    def updates_in_backward(self) -> bool:
        """Whether parameters are updated in backward (no clipping to wait for)."""
        return self.max_grad_norm is None and not self.defer_to_step

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.updates_in_backward or self._accumulating:
            return  # clipping needs every gradient first, or accumulating: step() updates
        if self.update_when is not None and not self.update_when():
            return
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
        ``max_grad_norm`` is set); those updated in backward have none left."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        waiting = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if waiting and self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(waiting, self.max_grad_norm)
        for p in waiting:
            self._update(p)
        return loss

    def _synchronize(self) -> None:
        """Host reads of the state wait for its copies back from the device."""
        if any(p.is_cuda for g in self.param_groups for p in g["params"]):
            torch.cuda.synchronize()

    def state_dict(self):
        self._synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        # PyTorch moves loaded state next to its parameter; this optimizer keeps it on the host.
        for p, state in self.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].device.type != "cpu":
                    host = torch.empty(
                        state[key].shape, dtype=state[key].dtype, pin_memory=self.pin_memory and p.is_cuda
                    )
                    state[key] = host.copy_(state[key])
            if "step" in state:
                state["step"] = state["step"].detach().to("cpu", torch.float32)

    def remove(self) -> None:
        """Detach the backward hooks (the optimizer then updates only in :meth:`step`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
