"""SGD (with momentum, dampening, Nesterov and weight decay) that updates each parameter during
backward, as soon as its gradient is complete, with its momentum buffer in (pinned) host memory.

The update is PyTorch's own SGD (``torch.optim.sgd.sgd``) on one parameter at a time, with the
implementation ``torch.optim.SGD`` would pick (its multi-tensor kernels for CUDA parameters,
the single-tensor loop on the CPU, the fused kernel when asked for): the parameters come out
bitwise those of ``torch.optim.SGD`` on the same gradients. The momentum buffer (one tensor of
the parameter's dtype, none without momentum) visits the GPU only for its parameter's update,
fetched ahead and written back on the copy streams (:mod:`.state_copies`). Clipping,
accumulation and deferred updates follow :class:`~offloadkit.optim.backward.BackwardOptimizer`.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.optim.sgd import sgd

from offloadkit.defaults import OPTIMIZER_COPY_WINDOW_BYTES
from offloadkit.optim.backward import BackwardOptimizer
from offloadkit.transfer.prefetch import PrefetchScheduler

__all__ = ["BackwardSGD"]

_KERNEL_KEYS = ("foreach", "fused")  # the constructor's choice wins over a checkpoint's


class BackwardSGD(BackwardOptimizer):
    """SGD updating in backward with a host-resident momentum buffer.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.SGD``.
        lr, momentum, dampening, weight_decay, nesterov, maximize: as for ``torch.optim.SGD``.
        max_grad_norm, pin_memory, update_when, defer_to_step: see
            :class:`~offloadkit.optim.backward.BackwardOptimizer`.
        foreach, fused: as for ``torch.optim.SGD``.
        copy_window_bytes: GPU memory for momentum buffers in flight, each way (None: 1 GiB).
        state_dir: keep the momentum buffers in memory-mapped files there (None: pinned memory).
        scheduler: the prefetch scheduler shared with the run's other copies (see
            :class:`~offloadkit.optim.backward.BackwardOptimizer`).

    Raises:
        ValueError: a negative ``lr``, ``momentum`` or ``weight_decay``; Nesterov without
            momentum or with dampening; both ``foreach`` and ``fused``.

    Example:
        >>> opt = BackwardSGD(model.parameters(), lr=1e-2, momentum=0.9)  # doctest: +SKIP
        >>> model(**batch).loss.backward()                                # updated here
        >>> opt.step(); opt.zero_grad()
    """

    STATE_KEYS = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        max_grad_norm: float | None = None,
        pin_memory: bool = True,
        update_when: Callable[[], bool] | None = None,
        defer_to_step: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        copy_window_bytes: int | None = None,
        state_dir: str | None = None,
        scheduler: PrefetchScheduler | None = None,
    ) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0.0:
                raise ValueError(f"{name}={value!r} is invalid; it must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening=0 (as torch.optim.SGD)")
        if foreach and fused:
            raise ValueError("foreach=True and fused=True: pick one SGD implementation (or neither: the default)")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "foreach": foreach,
            "fused": fused,
        }
        super().__init__(
            params,
            defaults,
            max_grad_norm=max_grad_norm,
            pin_memory=pin_memory,
            update_when=update_when,
            defer_to_step=defer_to_step,
            state_dir=state_dir,
            scheduler=scheduler,
            copy_window_bytes=copy_window_bytes or OPTIMIZER_COPY_WINDOW_BYTES["params"],
        )

    def _init_state(self, p: torch.Tensor, group: dict, state: dict) -> None:
        # torch.optim.SGD creates the buffer from the first gradient (a copy of it): the first
        # update makes it on the device, and it is then given a home on the host.
        pass

    def _apply(
        self, p: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, local: dict, state: dict, group: dict
    ) -> None:
        buffers = [local.get("momentum_buffer")]
        on_cuda = weight.is_cuda
        fused = group["fused"]
        foreach = group["foreach"] if group["foreach"] is not None else on_cuda and not fused
        sgd(
            [weight],
            [grad],
            buffers,
            foreach=foreach,
            fused=fused,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
        )
        if group["momentum"] != 0 and "momentum_buffer" not in local:
            created = buffers[0]
            host = self._host_zeros(weight, created.shape, created.dtype)
            if on_cuda:
                # Its first trip home: queued after the update on the copy stream, as every
                # later one is (the device tensor lives until the copy has read it).
                state["momentum_buffer"] = host
                self.state[p] = state  # where the copies look it up
                self._copies.store(p, {"momentum_buffer": created})
            else:
                state["momentum_buffer"] = host.copy_(created)

    def load_state_dict(self, state_dict) -> None:
        """Load a checkpoint's momentum buffers straight into host memory (PyTorch's loader
        would put every buffer on its parameter's device at once)."""
        for p, saved in self._load_groups(state_dict, keep=_KERNEL_KEYS):
            buf = (saved or {}).get("momentum_buffer")
            if buf is not None:
                host = self._host_zeros(p, buf.shape, p.dtype)
                self.state[p] = {"momentum_buffer": host.copy_(buf)}
