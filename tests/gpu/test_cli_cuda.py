"""The CLI on a GPU: the default run (offloadkit's peak below the plain run's for the same
step), and the Llama-3.2-1B shape with activation offloading, layer streaming and the disk
tier; the report's peak memory is the allocator's."""

import json

import pytest
import torch

from offloadkit.cli.main import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(
    "extra, check",
    [
        ("activation_offloading: true\n", lambda r: r["offloaded"]["activations_to_ram_bytes_per_step"] > 0),
        (
            "layer_offloading: true\nactivation_offloading: true\n",
            lambda r: r["offloaded"]["frozen_weights_streamed_bytes"] > 2**30,
        ),
        ("activation_offloading: disk\n", lambda r: r["offloaded"]["activations_to_disk_bytes_per_step"] > 0),
    ],
    ids=["ram", "layers", "disk"],
)
def test_cli_train_on_1b_shape(tmp_path, extra, check):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model_shape: llama-3.2-1b\nseq_len: 2048\nbatch_size: 1\nmax_steps: 4\nlogging_steps: 1\nlora_rank: 16\n"
        f"output_dir: {tmp_path / 'out'}\ngradient_checkpointing: true\nprofile_step: 2\n"
        + extra
        + (f"disk_dir: {tmp_path}\n" if "disk" in extra else "")
    )
    assert main(["train", str(config)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["peak_gpu_bytes"] == max(report["runs"]["with"]["step_peaks"]) > 0
    assert report["comparison"]["status"] in ("ok", "out of memory")
    assert check(report), report["offloaded"]
    assert report["steps"] == 4 and report["final_loss"] == report["final_loss"]  # finite
    assert (tmp_path / "out" / "memory_timeline.png").exists()
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").exists()


def test_cli_default_run_saves_gpu_memory_and_learns(tmp_path, clean_cuda):
    # Peaks are the process's: what earlier tests in this process left allocated is in both.
    earlier = torch.cuda.memory_allocated()
    assert main(["train", "--output-dir", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    comparison = report["comparison"]
    assert comparison["status"] == "ok", comparison
    without, with_ = (peak - earlier for peak in comparison["peak_bytes"])
    assert with_ < 0.7 * without, (earlier, comparison)  # the saving is visible
    assert report["final_loss"] < 0.5 * report["first_loss"]
    assert report["checkpointing_active"]
    assert report["offloaded"]["activations_to_ram_bytes_per_step"] > 0


def test_measured_rates_time_the_models_attention():
    """``offloadkit plan --measure`` (``Budgets.measure(shape=...)``) replaces the default
    attention rate by SDPA's own, timed with the model's heads: a long step's bound."""
    from offloadkit.planning import Budgets, resolve_shape

    budgets = Budgets(8 << 30, 8 << 30, 1 << 30)
    measured = budgets.measure(nbytes=64 << 20, shape=resolve_shape("llama-3-8b"), lora_rank=16)
    assert "attention" in measured.rates.source and "pcie" in measured.rates.source
    assert "layer linears" in measured.rates.source
    # bf16 GEMMs with their norms and adapters: between a tenth of the dense peak and the peak.
    assert 5e13 < measured.rates.matmul_flops_per_s < 2e15
    # A fused SDPA kernel on a current GPU: tens to hundreds of TFLOP/s, not the default by chance.
    assert 1e13 < measured.rates.attention_flops_per_s < 3e15
    assert measured.rates.attention_flops_per_s != budgets.rates.attention_flops_per_s
