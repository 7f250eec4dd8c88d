"""Optimizers whose state lives off the GPU: :class:`BackwardAdamW` and :class:`BackwardSGD`
update each parameter in backward, as soon as its gradient is complete, with their state in
(pinned) host memory; :func:`stochastic_round_to_bf16` is the compact option's rounding."""

from offloadkit.optim.backward import BackwardOptimizer
from offloadkit.optim.backward_adamw import BackwardAdamW
from offloadkit.optim.backward_sgd import BackwardSGD
from offloadkit.optim.rounding import stochastic_round_to_bf16

__all__ = ["BackwardAdamW", "BackwardOptimizer", "BackwardSGD", "stochastic_round_to_bf16"]
