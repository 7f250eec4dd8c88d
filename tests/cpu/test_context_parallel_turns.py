"""What context parallelism through the Trainer accepts before a step: right padding only
(padded positions never count in the loss), no packed documents, the config keys validated
with the field and the fix named."""

import pytest
import torch

from offloadkit.config import OffloadConfig
from offloadkit.parallel.turns import _check_positions, count_label_tokens, right_padded_labels


def test_right_padding_is_ignored_in_the_loss_and_left_padding_refused():
    labels = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    got = right_padded_labels(labels, mask)
    assert got.tolist() == [[5, 6, 7, 8], [5, 6, -100, -100]]
    assert int(count_label_tokens(got)) == 3 + 1  # the first token of a row is never a label
    with pytest.raises(ValueError, match="pad on the right"):
        right_padded_labels(labels, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="needs labels"):
        right_padded_labels(None, mask)


def test_packed_documents_are_refused():
    _check_positions(torch.arange(6).expand(2, 6))
    with pytest.raises(ValueError, match="packed documents"):
        _check_positions(torch.tensor([[0, 1, 2, 0, 1, 2]]))


def test_the_config_keys():
    config = OffloadConfig.from_dict({"context_parallel": True, "context_parallel_rotation": "alltoall"})
    assert (config.context_parallel, config.context_parallel_rotation) == (True, "alltoall")
    with pytest.raises(ValueError, match="context_parallel_rotation: ring is not a rotation"):
        OffloadConfig.from_dict({"context_parallel_rotation": "ring"})
    with pytest.raises(ValueError, match="context_parallel"):
        OffloadConfig.from_dict({"context_parallel": "yes"})


def test_one_process_notes_that_it_has_no_effect():
    from offloadkit.compose import prepare
    from offloadkit.testing import build_llama

    model = build_llama("tiny", attn_implementation="sdpa")
    runtime = prepare(model, {"context_parallel": True})
    assert runtime.handles.get("context_parallel") is None
    assert any("context_parallel has no effect with one process" in n for n in runtime.report()["notes"])
    runtime.close()


def test_offload_plan_auto_plans_a_rank_of_the_split_sequence(monkeypatch):
    from offloadkit.compose import plan_for
    from offloadkit.testing import build_llama

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model = build_llama("tiny", attn_implementation="sdpa")
    split = plan_for(model, OffloadConfig.from_dict({"context_parallel": True, "seq_len": 4096}))
    own = plan_for(model, OffloadConfig.from_dict({"seq_len": 4096}))
    assert split.workload.parallel.context_parallel and split.workload.parallel.world_size == 2
    assert split.workload.tokens == 2048 and own.workload.tokens == 4096
    assert not own.workload.parallel.context_parallel
    # The plan's keys name the rotation it counted (splitting stays the config's to say).
    assert split.to_config()["context_parallel_rotation"] in ("allgather", "alltoall")
    assert "context_parallel" not in split.to_config() and "context_parallel_rotation" not in own.to_config()
