"""AdamW that updates each parameter during backward, as soon as its gradient is complete,
with its moments kept in (pinned) host memory.

Two things leave the GPU: the optimizer state (two moments per parameter, 4 or 8 bytes each
in fp32) lives on the host and visits the GPU only for its parameter's update (in and out on
the copy streams, fetched ahead in the order of the last pass: :mod:`.state_copies`), and no
gradient outlives its update, so the model never holds a full set of gradients. For a full
fine-tune that is what a GPU holds beyond the weights: an 8B model in bf16 needs 16 GB of
gradients and 32-64 GB of AdamW state.

The update is PyTorch's own AdamW (``torch.optim.adamw.adamw``), called with the
implementation ``torch.optim.AdamW`` would use (its multi-tensor kernels for CUDA parameters,
the single-tensor loop on the CPU, or the fused kernel when asked for), so the result is bitwise
the one ``torch.optim.AdamW`` with the same ``foreach``/``fused`` gives on the same gradients
(same parameter dtype, same state dtype: the moments have the parameter's dtype, as in
PyTorch). The implementations round differently from each other: pick the one you compare
with.

Precision: by default the moments have the parameter's dtype and the update is applied to the
parameter itself, as ``torch.optim.AdamW`` does (pure bf16 for a bf16 model). With
``master_weights=True``, each bf16/fp16 parameter gets an fp32 master copy and fp32 moments
in host memory; its gradient is widened to fp32, the fp32 copy is updated, and the parameter
receives the copy rounded to its dtype: bitwise what ``torch.optim.AdamW`` over fp32 copies
of the parameters gives (mixed-precision training). That is 12 bytes of host state per
parameter instead of 4, streamed to the GPU and back at each update. With
``stochastic_rounding=True`` (the compact option, 4 bytes a parameter) the moments are bf16
and the update is computed in fp32 from widened copies, then rounded back to bf16
stochastically (:mod:`.rounding`): weights and moments keep, on average, the updates that
round-to-nearest bf16 would lose. It is not bitwise anything; its loss curve is measured
against fp32 master weights (``benchmarks/optimizer_precision.py``). The update runs in
chunks of ``chunk_elements`` so that its fp32 temporaries stay small for the embedding.

Gradient clipping by global norm needs every gradient before any update: with
``max_grad_norm`` the updates are deferred to :meth:`step` (the gradients are then held
until the end of backward, as without this optimizer), which clips exactly as
``torch.nn.utils.clip_grad_norm_`` and then updates parameter by parameter. Gradient
accumulation: inside ``with optimizer.accumulating():`` backward only accumulates; the
update happens in the backward after it (or at :meth:`step` when deferred). With a loss
scaler (fp16), pass ``defer_to_step=True`` and call ``scaler.step(optimizer)``: an update in
backward would apply scaled gradients and skip the scaler's inf/nan check. Under reentrant
checkpointing a parameter's gradient may come in pieces, one per segment's backward: such a
parameter is updated in :meth:`step`, once (see :mod:`offloadkit.optim.backward`).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.optim.adamw import adamw

from offloadkit.defaults import COMPACT_CHUNK_ELEMENTS, OPTIMIZER_COPY_WINDOW_BYTES, OPTIMIZER_STATE_BYTES
from offloadkit.optim.backward import BackwardOptimizer
from offloadkit.optim.rounding import stochastic_round_to_bf16
from offloadkit.transfer.prefetch import PrefetchScheduler

__all__ = ["BackwardAdamW"]

# A parameter's state tensors, host-resident; "master" only with fp32 master weights.
STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")
# The state_dict entry holding the compact option's generator states, by device type.
_RNG_KEY = "stochastic_rounding_rng"
# Group keys the constructor decides, not a checkpoint: the state's precision and the kernel.
_PRECISION_KEYS = ("master_weights", "stochastic_rounding", "fused", "foreach")


class BackwardAdamW(BackwardOptimizer):
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
        foreach, fused: as for ``torch.optim.AdamW``. None: multi-tensor kernels for CUDA
            parameters, the single-tensor loop for CPU ones (PyTorch's default).
        master_weights: keep an fp32 master copy and fp32 moments of every bf16/fp16
            parameter (fp32 parameters need none).
        stochastic_rounding: the compact option: bf16 moments for every parameter; the update
            in fp32, rounded stochastically to bf16 (bf16 parameters and the moments; fp32
            parameters keep the exact fp32 result, fp16 ones round to nearest).
        seed: the compact option's random source (one generator per device).
        copy_window_bytes: GPU memory for the state of CUDA parameters fetched ahead, and
            for the state still being copied back, each (at least one parameter's). None: 4 GiB
            with fp32 master weights, 1 GiB otherwise (about one 8B layer's state; measured in
            ``benchmarks/results/full-ft/window/``).
        state_dir: keep the state in memory-mapped files there, paged to disk past the RAM
            (see :class:`~offloadkit.optim.backward.BackwardOptimizer`); None: pinned memory.
        scheduler: the prefetch scheduler shared with the run's other copies (see
            :class:`~offloadkit.optim.backward.BackwardOptimizer`).

    Raises:
        ValueError: a negative ``lr``, a non-positive ``max_grad_norm``, both ``foreach``
            and ``fused``, or both ``master_weights`` and ``stochastic_rounding``.

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
        foreach: bool | None = None,
        fused: bool | None = None,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        seed: int = 0,
        chunk_elements: int = COMPACT_CHUNK_ELEMENTS,
        copy_window_bytes: int | None = None,
        state_dir: str | None = None,
        scheduler: PrefetchScheduler | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr={lr!r} is invalid; it must be >= 0")
        if foreach and fused:
            raise ValueError("foreach=True and fused=True: pick one AdamW implementation (or neither: the default)")
        if master_weights and stochastic_rounding:
            raise ValueError(
                "master_weights=True and stochastic_rounding=True: pick fp32 master state (12 bytes a parameter) "
                "or the compact bf16 state (4 bytes)"
            )
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements={chunk_elements!r} must be >= 1")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "foreach": foreach,
            "fused": bool(fused),
            "master_weights": master_weights,
            "stochastic_rounding": stochastic_rounding,
        }
        if copy_window_bytes is None:
            precision = "fp32_master" if master_weights else "compact" if stochastic_rounding else "params"
            copy_window_bytes = OPTIMIZER_COPY_WINDOW_BYTES[precision]
        self.seed = seed
        self.chunk_elements = chunk_elements
        self._generators: dict[torch.device, torch.Generator] = {}
        self._rng_restored: dict[str, torch.Tensor] = {}  # device type -> a checkpoint's state
        super().__init__(
            params,
            defaults,
            max_grad_norm=max_grad_norm,
            pin_memory=pin_memory,
            update_when=update_when,
            defer_to_step=defer_to_step,
            state_dir=state_dir,
            scheduler=scheduler,
            copy_window_bytes=copy_window_bytes,
        )

    @classmethod
    def for_precision(cls, params: Iterable, precision: str = "params", **kwargs) -> "BackwardAdamW":
        """A BackwardAdamW keeping its state in ``precision`` (the ``optimizer_precision`` names).

        Args:
            params: as for the constructor.
            precision: "params" (the parameters' dtype), "fp32_master" or "compact".
            **kwargs: the constructor's other arguments.

        Raises:
            ValueError: an unknown precision.
        """
        if precision not in OPTIMIZER_STATE_BYTES:
            names = ", ".join(OPTIMIZER_STATE_BYTES)
            raise ValueError(f"precision={precision!r} is not an optimizer precision; use one of {names}")
        return cls(
            params, master_weights=precision == "fp32_master", stochastic_rounding=precision == "compact", **kwargs
        )

    # -- the update --------------------------------------------------------------------
    STATE_KEYS = STATE_KEYS

    def _init_state(self, p: torch.Tensor, group: dict, state: dict) -> None:
        # The fused kernel counts steps on the parameter's device (a host count would make
        # every update wait for a copy back); the others read the count on the host.
        step_device = p.device if group["fused"] else "cpu"
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device=step_device)
        if self._keeps_master(p, group):
            state["master"] = self._host_zeros(p, p.shape, torch.float32).copy_(p.detach())
        dtype = self._moment_dtype(p, group)
        state["exp_avg"] = self._host_zeros(p, p.shape, dtype)
        state["exp_avg_sq"] = self._host_zeros(p, p.shape, dtype)

    @staticmethod
    def _keeps_master(p: torch.Tensor, group: dict) -> bool:
        return bool(group["master_weights"]) and p.dtype in (torch.bfloat16, torch.float16)

    def _moment_dtype(self, p: torch.Tensor, group: dict) -> torch.dtype:
        if self._keeps_master(p, group):
            return torch.float32
        if group.get("stochastic_rounding"):
            return torch.bfloat16
        return p.dtype  # as torch.optim.AdamW keeps them

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            restored = self._rng_restored.get(device.type)
            if restored is not None:
                gen.set_state(restored)
            self._generators[device] = gen
        return self._generators[device]

    def _apply(
        self, p: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, local: dict, state: dict, group: dict
    ) -> None:
        if group.get("stochastic_rounding"):
            self._compact_update(weight, grad, local, state["step"], group)
            return
        master = "master" in state
        target = local["master"] if master else weight
        self._adamw(
            target,
            grad.float() if master else grad,
            local["exp_avg"],
            local["exp_avg_sq"],
            state["step"],
            group,
            weight.is_cuda,
        )
        if master:
            weight.copy_(target)  # rounded to the parameter's dtype

    @staticmethod
    def _adamw(weight, grad, exp_avg, exp_avg_sq, step, group: dict, on_cuda: bool) -> None:
        """PyTorch's AdamW on one tensor, with the implementation ``torch.optim.AdamW`` picks."""
        beta1, beta2 = group["betas"]
        fused = group["fused"]
        foreach = group["foreach"] if group["foreach"] is not None else on_cuda and not fused
        adamw(
            [weight],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [step],
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=fused,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            has_complex=torch.is_complex(weight),
        )

    def _compact_update(
        self, p: torch.Tensor, grad: torch.Tensor, local: dict, step: torch.Tensor, group: dict
    ) -> None:
        """The compact option: AdamW in fp32 on widened chunks, rounded back stochastically."""
        gen = self._generator(p.device)
        tensors = [p.detach(), grad, local["exp_avg"], local["exp_avg_sq"]]
        if all(t.is_contiguous() for t in tensors):
            tensors = [t.view(-1) for t in tensors]  # chunks of the flat views write through
            length, per = p.numel(), self.chunk_elements
        else:
            # Strided (a 0-dim tensor is always contiguous): chunks of whole rows along the first
            # dimension, which are views that write through too.
            length = p.shape[0]
            per = max(1, self.chunk_elements // max(1, p.numel() // max(1, length)))
        weight, grad, exp_avg, exp_avg_sq = tensors
        for start in range(0, max(length, 1), per):
            part = slice(start, start + per)
            w32, m32, v32 = weight[part].float(), exp_avg[part].float(), exp_avg_sq[part].float()
            # Each chunk is the same step: it counts from a copy, the real count moves once below.
            self._adamw(w32, grad[part].float(), m32, v32, step.clone(), group, p.is_cuda)
            if p.dtype == torch.bfloat16:
                weight[part].copy_(stochastic_round_to_bf16(w32, gen))
            else:
                weight[part].copy_(w32)  # fp32 exactly; fp16 to nearest
            exp_avg[part].copy_(stochastic_round_to_bf16(m32, gen))
            exp_avg_sq[part].copy_(stochastic_round_to_bf16(v32, gen))
        step.add_(1)

    # -- the Optimizer interface -------------------------------------------------------------
    def state_dict(self):
        saved = super().state_dict()
        if self._generators:
            # The compact option's random streams: a resumed run rounds as the uninterrupted one.
            # Keyed by device type: under DDP every rank seeds alike and draws alike (replicas
            # stay equal), and the one rank that saves speaks for all of them.
            saved[_RNG_KEY] = {d.type: g.get_state() for d, g in self._generators.items()}
        return saved

    def load_state_dict(self, state_dict) -> None:
        """Load a checkpoint's state straight into host memory.

        PyTorch's loader would first move every state tensor next to its parameter (the whole
        state on the GPU at once) and round fp32 master state to the parameter's dtype; here
        the groups go through it and the state is placed by hand.

        The precision and kernel asked for at construction win over the checkpoint's: state
        saved under another precision is converted (a master copy made from the parameter,
        or dropped, the parameter being its rounding; moments cast to this precision's dtype).
        """
        loaded = self._load_groups(state_dict, keep=_PRECISION_KEYS)
        for key, rng in state_dict.get(_RNG_KEY, {}).items():
            kind = torch.device(key).type  # older checkpoints name a device ("cuda:0")
            # set_state takes a CPU byte tensor; the Trainer may have loaded it onto the GPU.
            self._rng_restored[kind] = rng.cpu()
            for device, gen in self._generators.items():
                if device.type == kind:
                    gen.set_state(self._rng_restored[kind])
        for p, saved in loaded:
            if saved:
                self.state[p] = self._converted(p, saved)

    def _converted(self, p: torch.Tensor, saved: dict) -> dict:
        """A checkpoint's state of ``p`` in host memory, in this optimizer's precision."""
        group = self._group(p)
        moment_dtype = self._moment_dtype(p, group)
        entry = {}
        for key, value in saved.items():
            if key == "step":
                where = p.device if group["fused"] else "cpu"
                entry[key] = torch.as_tensor(value).detach().to(where, torch.float32)
            elif key == "master":
                if self._keeps_master(p, group):
                    entry[key] = self._host_zeros(p, value.shape, torch.float32).copy_(value)
            elif isinstance(value, torch.Tensor):
                entry[key] = self._host_zeros(p, value.shape, moment_dtype).copy_(value)
            else:
                entry[key] = value
        if self._keeps_master(p, group) and "master" not in entry:
            entry["master"] = self._host_zeros(p, p.shape, torch.float32).copy_(p.detach())
        return entry
