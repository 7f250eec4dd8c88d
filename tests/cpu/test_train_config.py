"""TrainConfig from offloadkit's keys and from Axolotl configs: the mapping, the warnings for
keys without effect, and one-line errors naming the key, the value and the fix."""

import json
import warnings

import pytest

pytest.importorskip("transformers")

from offloadkit.cli.measure import RunMeasure  # noqa: E402
from offloadkit.cli.plot import plot_timelines  # noqa: E402
from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigError, OffloadConfig  # noqa: E402
from offloadkit.data import load_texts  # noqa: E402

AXOLOTL = {
    "base_model": "/models/llama",
    "datasets": [{"path": "data/train.jsonl", "type": "completion", "field": "body"}],
    "sequence_len": 512,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "num_epochs": 3,
    "learning_rate": "2e-4",
    "lr_scheduler": "cosine",
    "warmup_steps": 10,
    "optimizer": "adamw_torch",
    "adapter": "lora",
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.05,
    "lora_target_linear": True,
    "bf16": True,
    "seed": 42,
    "gradient_checkpointing": True,
    "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "activation_offloading": True,
    "layer_offloading": True,
    "output_dir": "./outputs/lora-out",
    "logging_steps": 1,
    "save_steps": 100,
    "max_steps": 20,
}


def _cfg(data, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = TrainConfig.from_dict(data, source="axolotl.yaml", cuda=False, **kw)
    return cfg, [str(w.message) for w in caught]


def test_axolotl_common_keys_map_onto_the_typed_config():
    cfg, messages = _cfg(AXOLOTL)
    assert (cfg.model, cfg.dataset, cfg.text_field) == ("/models/llama", "data/train.jsonl", "body")
    assert (cfg.seq_len, cfg.batch_size, cfg.gradient_accumulation_steps) == (512, 2, 4)
    assert cfg.learning_rate == 2e-4 and isinstance(cfg.learning_rate, float)  # PyYAML's string, accepted
    assert (cfg.num_epochs, cfg.max_steps, cfg.warmup_steps, cfg.lr_scheduler, cfg.optimizer) == (
        3,
        20,
        10,
        "cosine",
        "adamw_torch",
    )
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules) == (16, 32, 0.05, "all-linear")
    assert (cfg.dtype, cfg.seed, cfg.logging_steps, cfg.save_steps) == ("bfloat16", 42, 1, 100)
    assert cfg.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert cfg.offload == OffloadConfig.from_dict(
        {"gradient_checkpointing": True, "activation_offloading": True, "layer_offloading": True}
    )
    assert cfg.output_dir == "./outputs/lora-out"
    assert not messages


def test_axolotl_keys_without_effect_get_one_warning_listing_them():
    data = dict(
        AXOLOTL,
        load_in_8bit=False,
        sample_packing=True,
        wandb_project="x",
        val_set_size=0.05,
        flash_attention=True,
        deepspeed="zero3.json",
    )
    cfg, messages = _cfg(data)
    assert len(messages) == 1, messages
    assert "do not change the training and are not used: wandb_project, deepspeed" in messages[0]
    assert "load_in_8bit" not in messages[0]  # false asks for nothing
    assert cfg._ignored == ["wandb_project", "deepspeed"]
    assert cfg.sample_packing is True and cfg.val_set_size == 0.05  # these change the training: honoured
    assert cfg.attn_implementation == "flash_attention_2"  # flash_attention: true is honoured


def test_axolotl_offload_spelling_of_gradient_checkpointing():
    data = {k: v for k, v in AXOLOTL.items() if k != "activation_offloading"}
    cfg, _ = _cfg(dict(data, gradient_checkpointing="offload"))
    assert cfg.offload.gradient_checkpointing is True and cfg.offload.activation_offloading is True


def test_axolotl_without_adapter_is_a_full_fine_tune():
    data = {k: v for k, v in AXOLOTL.items() if k != "adapter"}
    cfg, messages = _cfg(data)
    assert cfg.lora_rank == 0 and cfg.lora_alpha is None
    assert len(messages) == 1 and "lora_r (no adapter: lora)" in messages[0]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sequence_length": 512}, "unknown key 'sequence_length'.*did you mean 'sequence_len'"),
        (
            {"load_in_8bit": True, "adapter": None},
            "load_in_8bit=True needs LoRA adapters",
        ),
        ({"cosine_constant_lr_ratio": 0.8}, "cosine_constant_lr_ratio=0.8: .* which offloadkit cannot honour"),
        (
            {"datasets": [{"path": "a.jsonl", "type": "oasst"}]},
            r"datasets\[0\].type='oasst': offloadkit train reads",
        ),
        ({"datasets": [{"path": "a.jsonl", "typ": "completion"}]}, r"datasets\[0\] has unknown keys \['typ'\]"),
        ({"seq_len": 128}, "seq_len and sequence_len are the same setting .seq_len.; keep one"),
        ({"learning_rate": "fast"}, "learning_rate='fast' is not a number"),
        ({"micro_batch_size": 0}, "micro_batch_size=0 must be an integer >= 1"),
        ({"lr_scheduler": "one_cycle"}, "lr_scheduler='one_cycle' is not a scheduler"),
    ],
)
def test_axolotl_mistakes_are_one_line_errors(change, message):
    with pytest.raises(ConfigError, match=message) as info:
        TrainConfig.from_dict(dict(AXOLOTL, **change), source="axolotl.yaml", cuda=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"dataset": ["a.jsonl", "b.jsonl"]}, r"dataset=\['a.jsonl', 'b.jsonl'\] must be one file path"),
        ({"output_dir": 3}, "output_dir=3 must be a path"),
        ({"max_steps": 0}, "max_steps=0 must be an integer >= 1"),
        ({"lora_target_modules": 5}, "lora_target_modules=5 must be"),
        ({"gradient_checkpointing_kwargs": {"reentrant": False}}, "gradient_checkpointing_kwargs=.* takes a mapping"),
        ({"report_to": 7}, "report_to=7 must be none, tensorboard"),
    ],
)
def test_native_mistakes_are_one_line_errors(data, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(data, cuda=False)


def test_native_config_accepts_yaml_string_numbers_and_device_defaults():
    cfg = TrainConfig.from_dict({"learning_rate": "1e-3"}, cuda=False)
    assert cfg.learning_rate == 1e-3
    assert (cfg.resolved(False).seq_len, cfg.resolved(False).batch_size) == (256, 4)
    assert (cfg.resolved(True).seq_len, cfg.resolved(True).batch_size) == (1024, 16)
    assert cfg.resolved(False).max_steps == 100
    assert TrainConfig.from_dict({"num_epochs": 2}, cuda=False).resolved(False).max_steps is None
    assert cfg.lora_rank == 0  # the default is a full fine-tune


def test_json_dataset_is_read_as_records(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"text": "first record"}, {"text": "second record"}]))
    assert load_texts(str(path)) == ["first record", "second record"]
    path.write_text(json.dumps({"data": [{"body": "x"}]}))
    assert load_texts(str(path), "body") == ["x"]
    with pytest.raises(ValueError, match="no 'text' field"):
        load_texts(str(path))


def test_plot_says_why_it_was_skipped(tmp_path):
    path, reason = plot_timelines(
        [RunMeasure("with offloadkit")],
        str(tmp_path / "p.png"),
        title="t",
        memory_label="RSS",
        profile_step=3,
        steps_run=2,
    )
    assert path is None and "the run had 2 steps and the timeline samples step 3" in reason
    assert "pip install" not in reason
