"""DeepSpeed ZeRO-2 and ZeRO-3 through the Trainer on one GPU, without and with offloadkit's
mixin (checkpoint-input offload): all 12 losses bitwise equal (eager attention), and the mixin
offloaded something. Each case runs in a process of its own (``benchmarks/deepspeed_probe.py
--one``): transformers remembers a ZeRO-3 config process-wide. Skips where DeepSpeed is not
installed (``benchmarks/device/suite_and_stacks.sh`` installs it from ``.whl/deepspeed``)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("deepspeed")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _case(tmp_path, stage: int, offload: int) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "deepspeed_probe.py"), "--out", str(tmp_path)]
        + ["--one", str(stage), str(offload)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])),
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RECORD ")]
    assert lines, proc.stderr[-3000:]
    record = json.loads(lines[-1][len("RECORD ") :])
    assert "error" not in record, record
    return record


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stage_with_the_mixin_trains_bitwise(tmp_path, stage):
    plain = _case(tmp_path, stage, 0)
    ours = _case(tmp_path, stage, 1)
    assert len(plain["losses"]) == 12 and ours["losses"] == plain["losses"]
    assert ours["offloaded_bytes"] > 0
