"""The timed Trainer run the Trainer-route GPU tests and benchmarks share: one record a step,
the engine's counters over that step alone, the configuration the run applied."""

import pytest
import torch

from offloadkit.testing import build_llama
from offloadkit.testing.trainer_runs import train_timed

pytest.importorskip("transformers")


def test_each_step_is_timed_with_the_engines_counters_over_it(tmp_path):
    torch.manual_seed(0)
    model = build_llama("tiny", vocab_size=259, num_hidden_layers=2)
    config = {"gradient_checkpointing": True, "activation_offloading": "disk", "disk_dir": str(tmp_path / "spill")}
    records = train_timed(model, config, output_dir=str(tmp_path / "out"), steps=3, seq_len=64)
    assert len(records) == 3 and all(r.seconds > 0 for r in records)
    offloaded = [r.stats.offloaded_tensors for r in records]
    # Counted afresh each step: every step offloads the same block inputs.
    assert offloaded[0] > 0 and len(set(offloaded)) == 1, offloaded
    assert all(r.config.activation_offloading == "disk" for r in records)
