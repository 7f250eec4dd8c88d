"""Planning a long-context step: what to keep, offload (RAM or disk) or recompute, how to
chunk the loss and tile the MLP, and the predicted GPU peak, host and disk use and step time.

- :mod:`~offloadkit.planning.shape`: a model's dimensions from a config, directory or name;
- :mod:`~offloadkit.planning.memory`: the byte model of one step;
- :mod:`~offloadkit.planning.timing`: FLOPs, copies, disk I/O and the step-time bound;
- :mod:`~offloadkit.planning.budgets`: GPU/RAM/disk budgets and rates, read or measured;
- :mod:`~offloadkit.planning.parallelism`: one rank of a run over several GPUs (a sequence
  split over them, ring attention's traffic, a host shared by its ranks);
- :mod:`~offloadkit.planning.planner`: :func:`plan` and :func:`longest_sequence`.

Example:
    >>> from offloadkit.planning import Budgets, plan
    >>> p = plan("llama-3-8b", 131072, lora_rank=16, budgets=Budgets(79 << 30, 100 << 30, 60 << 30))
    >>> print(p.table())  # doctest: +SKIP
"""

from offloadkit.planning.budgets import Budgets
from offloadkit.planning.capacity import Capacity, longest_sequence, physical_limit
from offloadkit.planning.memory import MemoryEstimate, Workload, estimate_memory
from offloadkit.planning.parallelism import Parallelism
from offloadkit.planning.plan import OptimizerSetup, Plan
from offloadkit.planning.planner import plan
from offloadkit.planning.shape import ModelShape, resolve_shape
from offloadkit.planning.timing import Rates, StepTime, estimate_time

__all__ = [
    "Budgets",
    "Capacity",
    "MemoryEstimate",
    "ModelShape",
    "OptimizerSetup",
    "Parallelism",
    "Plan",
    "Rates",
    "StepTime",
    "Workload",
    "estimate_memory",
    "estimate_time",
    "longest_sequence",
    "physical_limit",
    "plan",
    "resolve_shape",
]
