"""Helpers shared by the test suites, the demo and the benchmarks: tiny models built from
configs (no downloads), and bitwise comparison of losses and gradients."""

from offloadkit.testing.models import LLAMA_SHAPES, build_llama, make_batch
from offloadkit.testing.parity import assert_bitwise_equal, grads_of, run_step

__all__ = ["LLAMA_SHAPES", "assert_bitwise_equal", "build_llama", "grads_of", "make_batch", "run_step"]
