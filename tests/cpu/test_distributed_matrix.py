"""Each feature under DDP and under FSDP2, two ranks on CPU (gloo) under torchrun, one launch per
wrapper: against the same wrapper without the feature, bitwise where the feature is exact
(activation offloading, checkpointing with block inputs in RAM or on disk, LoRA, BackwardAdamW
against torch's AdamW, layer streaming under DDP), within a stated tolerance where it sums in
another order (chunked loss, tiled MLP, everything through prepare()); replicas equal after the
updates; under FSDP2 what cannot run is refused by prepare(). The matrix and its tolerances:
``tests/cpu/dist/matrix_worker.py``; the table: ``docs/multi-gpu.md``."""

import os
import sys

import pytest

from tests.torchrun import torchrun

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")

WORKER = os.path.join(os.path.dirname(__file__), "dist", "matrix_worker.py")
BOTH = [
    "engine",
    "ckpt-ram",
    "ckpt-disk",
    "chunked-loss",
    "tiled-mlp",
    "lora-ckpt",
    "backward-adamw",
    "together",
    "together-after",
]
CHECKS = {
    "ddp": BOTH + ["stream-frozen", "stream-frozen-after", "stream-trainable", "stream-lora-ckpt"],
    "fsdp2": BOTH + ["refused"],
}
NEEDS_PEFT = {"lora-ckpt", "stream-lora-ckpt"}


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_each_feature_under_the_wrapper_matches_the_wrapper_alone(wrapper):
    pytest.importorskip("transformers")
    proc = torchrun(WORKER, wrapper)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for name in CHECKS[wrapper]:
        check = f"{wrapper}-{name} "
        if name in NEEDS_PEFT and proc.stdout.count(f"SKIP {check}") == 2:
            continue
        assert proc.stdout.count(f"RESULT {check}") == 2, (check, proc.stdout[-2000:])
