"""Training across several processes: context parallelism (one sequence split across ranks).
Data parallelism and sharding are PyTorch's own (DDP, FSDP2); offloadkit works inside them."""

from offloadkit.parallel.context import ATTENTION, ContextParallel, apply_context_parallel, head_tail_order

__all__ = ["ATTENTION", "ContextParallel", "apply_context_parallel", "head_tail_order"]
