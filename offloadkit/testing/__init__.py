"""Helpers for tests of offloadkit and of code built on it: bitwise comparison of losses and
gradients, trackers of what a region allocates and saves, delayed copies for race tests, and
the model zoo (:mod:`offloadkit.models.zoo`) re-exported. Nothing in the library imports
this package."""

from offloadkit.models.zoo import LLAMA_SHAPES, build_llama, make_batch
from offloadkit.testing.allocations import AllocationTracker, SavedTensorTracker
from offloadkit.testing.delays import slow_copies
from offloadkit.testing.parity import assert_bitwise_equal, assert_equal_as_reruns, grads_of, run_step
from offloadkit.testing.references import Fp32MasterAdamW
from offloadkit.testing.steps import (
    GPU_LAYER_SHAPE,
    BackwardFailedError,
    failed_backward,
    lora_llama,
    memory_after_each_step,
    randomize_lora_b,
    step_on_side_stream,
)

__all__ = [
    "AllocationTracker",
    "BackwardFailedError",
    "Fp32MasterAdamW",
    "GPU_LAYER_SHAPE",
    "SavedTensorTracker",
    "LLAMA_SHAPES",
    "assert_bitwise_equal",
    "assert_equal_as_reruns",
    "build_llama",
    "failed_backward",
    "grads_of",
    "lora_llama",
    "make_batch",
    "memory_after_each_step",
    "randomize_lora_b",
    "run_step",
    "slow_copies",
    "step_on_side_stream",
]
