"""Optimizers whose state lives off the GPU: :class:`BackwardAdamW` updates each parameter
in backward, as soon as its gradient is complete, with its moments in (pinned) host memory."""

from offloadkit.optim.backward_adamw import BackwardAdamW

__all__ = ["BackwardAdamW"]
