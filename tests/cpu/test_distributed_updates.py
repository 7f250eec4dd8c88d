"""Updates in backward under data parallelism, two ranks on CPU (gloo) under torchrun: the
optimizer applies the gradient reduced over the ranks, never a rank's own, bitwise what
``torch.optim`` gives under the same wrapper, replicas equal across ranks (DDP with and
without bucket views, clipping, accumulation, unused-parameter search; FSDP2; context
parallelism; the Trainer mixin under DDP), and a run that does not say how gradients are
reduced is refused before any weight moves. And ``context_parallel: true`` through the
Trainer mixin: every rank's batch in turn, the weights those of the plain Trainer under DDP."""

import os
import sys

import pytest

from tests.torchrun import assert_ranks_reported, torchrun

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")

WORKER = os.path.join(os.path.dirname(__file__), "dist", "update_worker.py")
CHECKS = {
    "ddp": ["ddp-adamw", "ddp-sgd", "ddp-bucket-view", "ddp-clip", "ddp-accumulate", "ddp-unused", "ddp-unsaid"],
    "fsdp2": ["fsdp2-adamw", "fsdp2-sgd", "fsdp2-clip", "fsdp2-accumulate-accumulating", "fsdp2-accumulate-no-sync"],
    "cp": ["cp-adamw", "cp-clip"],
    "trainer": ["trainer-ddp-unused-False", "trainer-ddp-unused-None"],
    "trainer_cp": ["trainer-cp"],
}


@pytest.mark.parametrize("route", sorted(CHECKS))
def test_updates_in_backward_apply_the_reduced_gradient(route):
    if route.startswith("trainer"):
        pytest.importorskip("transformers")
    assert_ranks_reported(torchrun(WORKER, route), CHECKS[route])
