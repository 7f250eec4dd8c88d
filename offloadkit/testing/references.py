"""Untouched references that offloadkit's own implementations are compared with."""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["Fp32MasterAdamW"]


class Fp32MasterAdamW(torch.optim.AdamW):
    """Mixed-precision AdamW as written by hand: ``torch.optim.AdamW`` over fp32 copies of
    low-precision parameters; gradients widened to fp32, the copies updated, the parameters
    given the copies rounded to their dtype. An ``Optimizer`` (schedulers and the Trainer
    drive it); its param groups hold the fp32 copies.

    Args:
        params: the model's parameters (one group).
        **kwargs: ``torch.optim.AdamW`` arguments (lr, weight_decay, foreach, fused, ...).
    """

    def __init__(self, params: Iterable[torch.Tensor], **kwargs):
        self.model_params = list(params)
        super().__init__([p.detach().float().clone().requires_grad_(True) for p in self.model_params], **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        masters = self.param_groups[0]["params"]
        for p, m in zip(self.model_params, masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        loss = super().step(closure)
        for p, m in zip(self.model_params, masters):
            p.copy_(m)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        super().zero_grad(set_to_none)
