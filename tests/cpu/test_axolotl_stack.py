"""``benchmarks/axolotl_stack.py`` on a CPU: Axolotl's own tiled MLP and checkpoint-input
offloading (``activation_offloading: hidden_states``) applied to the tiny model, one step, a
finite loss, and each part read back from the model and trainer.

The rest of the stack needs CUDA and is left out of this run: TRL's offloader (what
``gradient_checkpointing: offload`` means) and the legacy checkpointer use CUDA streams and
copies, LayerOffloadManager offloads only parameters on a CUDA device, and Liger's kernels are
Triton. Skips where Axolotl (with TRL) is not installed, as in CI; the refusals and the config
keys are checked everywhere."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS = os.path.join(REPO, "benchmarks", "axolotl_stack.py")
sys.path.insert(0, REPO)

from benchmarks import axolotl_stack  # noqa: E402


def test_the_default_keys_are_axolotls_long_context_keys():
    keys = axolotl_stack.config_keys(axolotl_stack.PARTS, "true", None)
    assert keys["gradient_checkpointing"] == "offload"
    assert keys["layer_offloading"] is True
    assert keys["tiled_mlp"] is True and keys["tiled_mlp_use_original_mlp"] is True
    assert keys["liger_fused_linear_cross_entropy"] is True
    assert keys["plugins"] == ["axolotl.integrations.liger.LigerPlugin"]


@pytest.mark.parametrize("parts", ["liger", "layer_offloading", "offload"])
def test_parts_that_need_cuda_are_refused_on_a_cpu(parts):
    with pytest.raises(SystemExit, match="need CUDA"):
        axolotl_stack.main(["--device", "cpu", "--shape", "tiny", "--parts", parts])


def test_the_deepspeed_stand_in_leaves_nothing_behind():
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("DeepSpeed is installed: Axolotl imports the real one")
    with axolotl_stack._deepspeed_stand_in():
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        with pytest.raises(RuntimeError, match="only under DeepSpeed"):
            TiledMLP.apply()
    assert not [name for name in sys.modules if name.split(".")[0] == "deepspeed"]


def test_the_stack_runs_a_step_on_a_cpu_with_each_part_applied(tmp_path):
    if importlib.util.find_spec("axolotl") is None:
        pytest.skip("axolotl is not installed (the harness imports Axolotl's own modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, HARNESS, "--device", "cpu", "--shape", "tiny", "--seq-len", "256", "--layers", "2"]
    cmd += ["--steps", "1", "--warmup", "0", "--parts", "offload,tiled_mlp", "--activation-offloading", "hidden_states"]
    cmd += ["--tiled-mlp-num-shards", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    files = list(tmp_path.glob("axolotl-stack-tiny-256-2L*.json"))
    assert files, proc.stderr[-3000:]
    result = json.loads(files[0].read_text())
    if result["status"] == "error" and result["note"].startswith(("ModuleNotFoundError", "ImportError")):
        pytest.skip(f"an Axolotl module does not import here: {result['note']}")
    assert proc.returncode == 0 and result["status"] == "ok", (result.get("note"), proc.stderr[-3000:])
    assert math.isfinite(result["loss"]) and result["step_s"] > 0
    assert result["parts"] == ["offload", "tiled_mlp"]
    assert result["axolotl_keys"]["activation_offloading"] == "hidden_states"
    assert result["axolotl_version"]

    offload = result["applied"]["offload"]
    assert offload["checkpointed_layers"] == 2 and offload["use_reentrant"] is False
    assert offload["context"] == "CheckpointHiddenStatesOffload"
    # Each layer's input was marked for offloading (on a CPU it stays where it is).
    assert offload["stats"]["marked_tensors"] == 2

    tiled = result["applied"]["tiled_mlp"]
    assert tiled["forward"] == "tiled_mlp_forward" and tiled["num_shards"] == 2
    assert tiled["ran"] == 2 and tiled["impl"] == ["TiledMLP"]

    row = proc.stdout.strip().splitlines()[-1]
    assert row.startswith("| axolotl: offload+tiled_mlp (hidden_states) | 256 | 2 | ok |")
