"""Untouched references that offloadkit's own implementations are compared with."""

from __future__ import annotations

import torch

__all__ = ["Fp32MasterAdamW"]


class Fp32MasterAdamW:
    """Mixed-precision AdamW as written by hand: ``torch.optim.AdamW`` over fp32 copies of a
    low-precision model's parameters; gradients widened to fp32, the copies updated, the
    model's parameters given the copies rounded to their dtype.

    Args:
        model: a module whose parameters are updated.
        **kwargs: ``torch.optim.AdamW`` arguments (lr, weight_decay, foreach, fused, ...).
    """

    def __init__(self, model: torch.nn.Module, **kwargs):
        self.params = list(model.parameters())
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, **kwargs)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float()
            p.grad = None
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m)
