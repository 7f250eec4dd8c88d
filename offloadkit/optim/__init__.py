"""Optimizers whose state lives off the GPU: :class:`BackwardAdamW` updates each parameter
in backward, as soon as its gradient is complete, with its moments in (pinned) host memory;
:func:`stochastic_round_to_bf16` is its compact option's rounding."""

from offloadkit.optim.backward_adamw import BackwardAdamW
from offloadkit.optim.rounding import stochastic_round_to_bf16

__all__ = ["BackwardAdamW", "stochastic_round_to_bf16"]
