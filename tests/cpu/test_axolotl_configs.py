"""Axolotl configs as Axolotl users write them: empty keys, Axolotl's own values, the alpaca
and chat_template dataset types with the loss where Axolotl puts it, QLoRA, every problem of
a config at once, and the benchmark over a repository's example configs."""

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("transformers")
yaml = pytest.importorskip("yaml")

from offloadkit.cli.preflight import preflight  # noqa: E402
from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigError, ConfigProblemsError  # noqa: E402
from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.data.sft import IGNORE, DatasetSpec, build_examples  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = {
    "base_model": None,
    "sequence_len": 256,
    "micro_batch_size": 2,
    "learning_rate": 1e-3,
    "num_epochs": 1,
    "output_dir": "./out",
    "optimizer": "adamw_torch",
    "lr_scheduler": "cosine",
    "bf16": "auto",
}


def _cfg(data):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = TrainConfig.from_dict(data, source="axolotl.yaml", cuda=False)
    return cfg, [str(w.message) for w in caught]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_empty_keys_are_unset():
    cfg, _ = _cfg(
        dict(
            BASE,
            adapter=None,
            lora_r=None,
            lora_alpha=None,
            chat_template=None,
            wandb_project="",
            resume_from_checkpoint=None,
            special_tokens=None,
            gradient_checkpointing=True,
        )
    )
    assert cfg.model is None and cfg.lora_rank == 0 and cfg.resume_from_checkpoint is None
    assert cfg.dtype == "auto" and cfg.offload.gradient_checkpointing


@pytest.mark.parametrize(
    "keys, checkpointing, offloading",
    [
        ({"gradient_checkpointing": "offload"}, True, True),
        ({"gradient_checkpointing": "offload_disk"}, True, "disk"),
        ({"gradient_checkpointing": True, "activation_offloading": "hidden_states"}, True, True),
        ({"gradient_checkpointing": True, "activation_offloading": "legacy"}, True, "legacy"),
    ],
)
def test_axolotl_offloading_values(keys, checkpointing, offloading):
    cfg, _ = _cfg(dict(BASE, **keys))
    assert cfg.offload.gradient_checkpointing is checkpointing and cfg.offload.activation_offloading == offloading


def test_attention_implementation_is_honoured_or_falls_back_with_a_warning(tmp_path):
    cfg, _ = _cfg(dict(BASE, attn_implementation="eager", output_dir=str(tmp_path / "a")))
    assert cfg.attn_implementation == "eager"
    cfg, _ = _cfg(dict(BASE, attn_implementation="flash_attention_2", output_dir=str(tmp_path / "b")))
    cfg = cfg.resolved(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        preflight(cfg)
    assert cfg.attn_implementation == "sdpa"  # no flash-attn kernel without a GPU
    assert any("attn_implementation='flash_attention_2' has no effect here" in str(w.message) for w in caught)


def test_axolotl_batch_size_is_the_whole_step():
    cfg, _ = _cfg(dict(BASE, micro_batch_size=2, batch_size=16))
    assert cfg.batch_size == 2 and cfg.gradient_accumulation_steps == 8


def test_every_problem_is_reported_at_once_on_one_line():
    data = dict(BASE, lerning_rate=1e-4, rl="grpo", adapter="dora", relora=True)
    with pytest.raises(ConfigProblemsError) as info:
        TrainConfig.from_dict(data, source="axolotl.yaml", cuda=False)
    message = str(info.value)
    assert "\n" not in message and "4 problems" in message
    assert "unknown key 'lerning_rate'" in message and "did you mean 'learning_rate'?" in message
    assert "rl='grpo': RL and preference training" in message and "adapter='dora' is not supported" in message
    assert "relora=True: ReLoRA" in message
    assert not info.value.unsupported_only
    with pytest.raises(ConfigProblemsError) as info:
        TrainConfig.from_dict(dict(BASE, rl="grpo", processor_type="AutoProcessor"), source="a.yaml", cuda=False)
    assert info.value.unsupported_only  # refused only for features offloadkit does not have


def test_alpaca_records_train_only_on_the_response(tmp_path):
    tok = byte_tokenizer()
    path = _jsonl(
        tmp_path / "a.jsonl",
        [
            {"instruction": "Add 1 and 2.", "input": "", "output": "3"},
            {"instruction": "Sum", "input": "4 5", "output": "9"},
        ],
    )
    examples, dropped = build_examples(DatasetSpec(path=path, type="alpaca"), tok, 512)
    assert dropped == 0 and len(examples) == 2
    for (ids, labels), answer in zip(examples, ("3", "9")):
        trained = [t for t, lab in zip(ids, labels) if lab != IGNORE]
        assert tok.decode(trained) == answer + tok.eos_token
        assert "### Response:\n" in tok.decode(ids)
    assert "### Input:\n4 5" in tok.decode(examples[1][0]) and "### Input" not in tok.decode(examples[0][0])
    everything, _ = build_examples(DatasetSpec(path=path, type="alpaca"), tok, 512, train_on_inputs=True)
    assert all(ids == labels for ids, labels in everything)
    short, dropped = build_examples(DatasetSpec(path=path, type="alpaca"), tok, len(examples[0][0]))
    assert dropped == 1 and short == examples[:1]  # longer than seq_len: dropped, as Axolotl does
    with pytest.raises(ValueError, match=r"no example fits in seq_len=20 .* \(2 longer ones dropped\)"):
        build_examples(DatasetSpec(path=path, type="alpaca"), tok, 20)


def test_chat_records_train_on_the_assistant_turns_with_mapped_fields(tmp_path):
    tok = byte_tokenizer()
    conversation = [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello."},
        {"from": "human", "value": "Bye"},
        {"from": "gpt", "value": "Goodbye."},
    ]
    path = _jsonl(tmp_path / "c.jsonl", [{"conversations": conversation}])
    spec = DatasetSpec(
        path=path,
        type="chat_template",
        field_messages="conversations",
        message_property_mappings={"role": "from", "content": "value"},
    )
    [(ids, labels)], _ = build_examples(spec, tok, 1024)
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])
    assert trained == "Hello.<|im_end|>\nGoodbye.<|im_end|>\n"  # no role headers, no user or system text
    assert "<|im_start|>system\nBe brief." in tok.decode(ids)
    spec.drop_system_message, spec.roles_to_train = True, ["user", "assistant"]
    [(ids, labels)], _ = build_examples(spec, tok, 1024)
    assert "system" not in tok.decode(ids) and "Hi" in tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])
    with pytest.raises(ValueError, match="no list of messages under 'messages'"):
        build_examples(DatasetSpec(path=path, type="chat_template"), tok, 1024)


def test_axolotl_datasets_map_to_typed_specs(tmp_path):
    alpaca = _jsonl(tmp_path / "a.jsonl", [{"instruction": "x", "output": "y"}])
    chats = _jsonl(
        tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    )
    cfg, _ = _cfg(
        dict(
            BASE,
            datasets=[
                {"path": alpaca, "type": "alpaca"},
                {"path": chats, "type": "chat_template", "split": "train", "roles_to_train": ["assistant"]},
            ],
        )
    )
    specs = cfg.dataset_specs()
    assert [s.type for s in specs] == ["alpaca", "chat_template"] and specs[1].roles_to_train == ["assistant"]
    with pytest.raises(ConfigError, match=r"datasets\[0\] has field_chosen, field_rejected"):
        _cfg(
            dict(BASE, datasets=[{"path": chats, "type": "chat_template", "field_chosen": "c", "field_rejected": "r"}])
        )


def test_qlora_maps_to_a_4bit_base():
    cfg, _ = _cfg(dict(BASE, adapter="qlora", load_in_4bit=True, lora_r=8, lora_target_linear=True))
    assert cfg.load_in_4bit and cfg.lora_rank == 8 and cfg.lora_target_modules == "all-linear"
    with pytest.raises(ConfigError, match="load_in_4bit=True needs LoRA adapters"):
        TrainConfig.from_dict({"load_in_4bit": True}, cuda=False)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_qlora_alpaca_run_trains_and_saves_an_adapter(tmp_path):
    data = _jsonl(
        tmp_path / "a.jsonl", [{"instruction": f"Add {i} and 1.", "input": "", "output": str(i + 1)} for i in range(24)]
    )
    config = dict(
        BASE,
        model_shape="tiny",
        adapter="qlora",
        load_in_4bit=True,
        lora_r=4,
        lora_target_linear=True,
        max_steps=3,
        output_dir=str(tmp_path / "out"),
        compare=False,
        gradient_checkpointing=True,
        datasets=[{"path": data, "type": "alpaca"}],
        logging_steps=1,
    )
    path = tmp_path / "qlora.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, "-m", "offloadkit", "train", str(path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "4-bit" in report["model"] and report["fine_tune"] == "LoRA r=4" and report["steps"] == 3
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").exists()


def test_examples_benchmark_checks_and_trains_a_checkout(tmp_path):
    """benchmarks/axolotl_examples.py over a git repository of example configs: each checked as
    written (one line per problem, no traceback), and trained 2 steps on a stand-in of its
    architecture with a local dataset of its type, or refused with one line."""
    repo = tmp_path / "axolotl"
    examples = repo / "examples" / "demo"
    examples.mkdir(parents=True)
    good = dict(
        BASE,
        base_model="NousResearch/Llama-3.2-1B",
        datasets=[{"path": "mhenrichsen/alpaca_2k_test", "type": "alpaca", "split": "train[:5%]"}],
        adapter="lora",
        lora_r=8,
        lora_target_linear=True,
        gradient_checkpointing=True,
        sample_packing=True,
        val_set_size=0.1,
        warmup_ratio=0.1,
        special_tokens={"pad_token": "<|end_of_text|>"},
    )
    (examples / "good.yml").write_text(yaml.safe_dump(good))
    (examples / "rl.yml").write_text(yaml.safe_dump(dict(good, rl="grpo")))
    (examples / "typo.yml").write_text(yaml.safe_dump(dict(good, lora_alhpa=16)))
    (examples / "no-model.yml").write_text(yaml.safe_dump({"something": 1}))
    for command in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(repo), *command], check=True, capture_output=True)
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "axolotl_examples.py"), str(repo), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split("\t")[0]: line.split("\t") for line in (out / "results.tsv").read_text().splitlines()[1:]}
    assert rows["examples/demo/good.yml"][3] == "trained"
    assert rows["examples/demo/rl.yml"][3] == "refused" and "rl='grpo'" in rows["examples/demo/rl.yml"][4]
    assert rows["examples/demo/typo.yml"][3] == "refused" and "'lora_alhpa'" in rows["examples/demo/typo.yml"][4]
    assert rows["examples/demo/no-model.yml"][3] == "skipped"
    assert rows["examples/demo/good.yml"][1] == "2 problems"  # a hub id not cached, a hub dataset
    summary = (out / "summary.md").read_text()
    assert "3 configs with a base_model: **1 trained**, 2 refused" in summary
    assert "0 with a traceback or a line not naming the config" in summary


def test_unknown_keys_of_an_axolotl_config_are_one_short_line():
    """Axolotl's modal.yaml keys (the cloud runner's) next to a training config: named, the first
    few and how many, with where the keys are listed; not every known key, nor the values."""
    modal = {
        "project_name": "x" * 300,
        "volumes": [{"name": "axolotl-data", "mount": "/workspace/data"}] * 20,
        "secrets": ["HF_TOKEN", "WANDB_API_KEY"],
        "branch": "main",
        "gpu": "h100",
        "gpu_count": 1,
        "memory": 128,
        "timeout": 86400,
        "memory_preprocess": 32,
        "timeout_preprocess": 14400,
    }
    with pytest.raises(ConfigProblemsError) as info:
        TrainConfig.from_dict(dict(BASE, lerning_rate=1e-4, **modal), source="axolotl.yaml", cuda=False)
    message = str(info.value)
    assert len(message) <= 200 and "\n" not in message, (len(message), message)
    assert message.startswith("axolotl.yaml: 11 unknown keys: 'lerning_rate' (did you mean 'learning_rate'?)")
    assert "more; see offloadkit train --help for the keys" in message
    assert "wandb_project" not in message and "HF_TOKEN" not in message


def test_unknown_dataset_keys_are_named_without_listing_every_key():
    entry = {"path": "a.jsonl", "type": "completion", "fields": "text", "foo": 1, "bar": 2, "baz": 3}
    with pytest.raises(ConfigProblemsError) as info:
        TrainConfig.from_dict(dict(BASE, datasets=[entry]), source="axolotl.yaml", cuda=False)
    message = str(info.value)
    assert len(message) <= 200 and "\n" not in message, (len(message), message)
    assert "datasets[0] has unknown keys ['fields', 'foo', 'bar'] and 1 more" in message
    assert "did you mean 'field' for 'fields'?" in message and "drop them" in message
    assert "preprocess_shards" not in message  # not the list of the keys offloadkit reads


def test_flex_attention_falls_back_to_sdpa_on_a_cpu(tmp_path):
    cfg, _ = _cfg(dict(BASE, attn_implementation="flex_attention", output_dir=str(tmp_path / "f")))
    cfg = cfg.resolved(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        preflight(cfg)
    if torch_cuda_available():
        assert cfg.attn_implementation == "flex_attention"
    else:  # FlexAttention has no backward on a CPU; sdpa computes the same attention
        assert cfg.attn_implementation == "sdpa"
        assert any("FlexAttention has no backward on a CPU" in str(w.message) for w in caught)


def torch_cuda_available():
    import torch

    return torch.cuda.is_available()


def test_ray_workers_are_a_multi_gpu_layout_without_effect_here(tmp_path):
    cfg, caught = _cfg(dict(BASE, use_ray=True, ray_num_workers=4, output_dir=str(tmp_path / "r")))
    assert "use_ray" in cfg._ignored and "ray_num_workers" in cfg._ignored
    assert any("use_ray, ray_num_workers" in message for message in caught)
