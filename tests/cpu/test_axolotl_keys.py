"""Axolotl keys that change the training, honoured: each one in a tiny run of 1 to 12 steps
(``offloadkit train`` in this process, with a callback slipped into its Trainer to read what
the key set), a key that cannot be honoured refused with one line (or dropped on request),
and a hub id resolved from a local Hugging Face cache."""

import json
import math

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
yaml = pytest.importorskip("yaml")
torch = pytest.importorskip("torch")

import offloadkit.cli.train as train_module  # noqa: E402
from offloadkit.cli.main import main  # noqa: E402
from offloadkit.cli.train import run_train  # noqa: E402
from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigError, ConfigProblemsError  # noqa: E402
from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.data.packing import pack_examples, packed_collate, packing_keeps_documents_apart  # noqa: E402
from offloadkit.data.sft import IGNORE, DatasetSpec, build_examples, split_bounds  # noqa: E402
from offloadkit.models.zoo import build_llama  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401

_QUIET = train_module._quiet


def _alpaca(path, n=40):
    path.write_text(
        "".join(
            json.dumps({"instruction": f"Add {i} and 1.", "input": "", "output": str(i + 1)}) + "\n" for i in range(n)
        )
    )
    return str(path)


def _axolotl(tmp_path, **keys):
    """A tiny Axolotl config: the built-in tiny model, an alpaca file, LoRA, no comparison."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = {
        "base_model": None,
        "model_shape": "tiny",
        "datasets": [{"path": _alpaca(tmp_path / "alpaca.jsonl"), "type": "alpaca"}],
        "sequence_len": 256,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "lr_scheduler": "constant",
        "optimizer": "adamw_torch",
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 16,
        "lora_target_linear": True,
        "bf16": False,
        "output_dir": str(tmp_path / "out"),
        "gradient_checkpointing": False,
        "compare": False,
        "logging_steps": 1,
    }
    config.update(keys)
    return {k: v for k, v in config.items() if v is not ...}


class _Seen:
    """What the run's Trainer had: its arguments, the learning rate after each step, the
    optimizer's settings, and whatever ``probe(trainer)`` returns at the first step."""

    def __init__(self, probe=None):
        self.probe = probe
        self.lrs: list[float] = []
        self.groups: list[dict] = []
        self.found = None
        self.args = None


def _run(tmp_path, monkeypatch, config, probe=None, drop=False):
    seen = _Seen(probe)

    class Record(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen.args = args
            if seen.probe is not None:
                seen.found = seen.probe(model)

        def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            seen.lrs.append(lr_scheduler.get_last_lr()[0])
            seen.groups.append({k: v for k, v in optimizer.param_groups[0].items() if k != "params"})

    def with_callback(trainer):
        trainer.add_callback(Record())
        return _QUIET(trainer)

    monkeypatch.setattr(train_module, "_quiet", with_callback)
    cfg = TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False, drop_unsupported_keys=drop)
    report = run_train(cfg, log=lambda *a: None)
    return seen, report


def test_warmup_ratio_is_the_same_schedule_as_its_warmup_steps(tmp_path, monkeypatch):
    keys = dict(max_steps=8, lr_scheduler="constant_with_warmup")
    ratio, _ = _run(tmp_path / "a", monkeypatch, _axolotl(tmp_path / "a", warmup_ratio=0.25, **keys))
    steps, _ = _run(tmp_path / "b", monkeypatch, _axolotl(tmp_path / "b", warmup_steps=2, **keys))
    assert ratio.lrs == steps.lrs
    assert ratio.lrs[:3] == pytest.approx([0.5e-3, 1e-3, 1e-3])  # 2 of the 8 steps warm up
    # Neither given: Axolotl's default, 3% of the steps (rounded down) at most 100.
    default_config = _axolotl(tmp_path / "c", max_steps=70, lr_scheduler="constant_with_warmup")
    default, _ = _run(tmp_path / "c", monkeypatch, default_config)
    assert default.lrs[:2] == pytest.approx([0.5e-3, 1e-3])  # int(0.03 x 70) = 2 steps
    with pytest.raises(ConfigError, match="warmup_ratio and warmup_steps both set the warmup"):
        TrainConfig.from_dict(_axolotl(tmp_path, warmup_ratio=0.1, warmup_steps=3), cuda=False)


def test_cosine_min_lr_ratio_ends_at_that_fraction(tmp_path, monkeypatch):
    seen, _ = _run(
        tmp_path, monkeypatch, _axolotl(tmp_path, lr_scheduler="cosine", max_steps=4, cosine_min_lr_ratio=0.1)
    )
    assert seen.args.lr_scheduler_type == "cosine_with_min_lr"
    assert seen.lrs[-1] == pytest.approx(1e-4)  # 0.1 of 1e-3 at the end of the run
    assert min(seen.lrs) >= 1e-4 - 1e-12


def test_adam_betas_and_epsilon_reach_the_optimizer(tmp_path, monkeypatch):
    config = _axolotl(tmp_path, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
    seen, _ = _run(tmp_path, monkeypatch, config)
    assert seen.groups[0]["betas"] == (0.8, 0.95) and seen.groups[0]["eps"] == 1e-6
    with pytest.raises(ConfigProblemsError, match="adam_beta2=0.95 applies to Adam-family optimizers, not optimizer"):
        TrainConfig.from_dict(_axolotl(tmp_path, optimizer="sgd", adam_beta2=0.95), cuda=False)


def test_neftune_noise_alpha_reaches_the_embeddings(tmp_path, monkeypatch):
    def alpha(model):
        return getattr(model.get_input_embeddings(), "neftune_noise_alpha", None)

    seen, _ = _run(tmp_path, monkeypatch, _axolotl(tmp_path, neftune_noise_alpha=5), probe=alpha)
    assert seen.args.neftune_noise_alpha == 5 and seen.found == 5


def test_peft_use_rslora_scales_by_the_square_root_of_the_rank(tmp_path, monkeypatch):
    def scaling(model):
        return {m.scaling["default"] for m in model.modules() if isinstance(getattr(m, "scaling", None), dict)}

    rs, _ = _run(tmp_path / "a", monkeypatch, _axolotl(tmp_path / "a", peft_use_rslora=True), probe=scaling)
    plain, _ = _run(tmp_path / "b", monkeypatch, _axolotl(tmp_path / "b"), probe=scaling)
    assert rs.found == {16 / math.sqrt(4)} and plain.found == {16 / 4}
    saved = json.loads((tmp_path / "a" / "out" / "adapter" / "adapter_config.json").read_text())
    assert saved["use_rslora"] is True


def test_lora_model_dir_trains_the_saved_adapter_further(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    _run(tmp_path / "a", monkeypatch, _axolotl(tmp_path / "a", lora_r=2, max_steps=3))
    adapter = tmp_path / "a" / "out" / "adapter"
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    base = tmp_path / "a" / "out" / "base"

    def weights(model):
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    config = _axolotl(tmp_path / "b", base_model=str(base), lora_model_dir=str(adapter), lora_r=8)
    config.pop("model_shape")
    seen, report = _run(tmp_path / "b", monkeypatch, config, probe=weights)
    assert len(seen.found) == len(saved) > 0
    for name, tensor in saved.items():  # the run starts from the saved adapter's weights
        key = name.replace(".weight", ".default.weight")
        assert torch.equal(seen.found[key], tensor), name
    assert all(t.shape[0] == 2 or t.shape[1] == 2 for t in seen.found.values())  # the adapter's own rank
    assert report["steps"] == 2
    with pytest.raises(ConfigError, match="lora_model_dir=.* holds no adapter_config.json"):
        _run(tmp_path / "c", monkeypatch, dict(config, lora_model_dir=str(tmp_path), output_dir=str(tmp_path / "c")))


def test_special_tokens_and_tokens_grow_the_tokenizer_and_the_embeddings(tmp_path, monkeypatch):
    config = _axolotl(
        tmp_path,
        adapter=None,
        special_tokens={"pad_token": "<|pad|>"},
        tokens=["<|im_start|>", "<|im_end|>"],
        resize_token_embeddings_to_32x=True,
    )
    _run(tmp_path, monkeypatch, config)
    saved = tmp_path / "out" / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(saved)
    model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    assert tokenizer.pad_token == "<|pad|>" and len(tokenizer) == 259 + 3
    assert tokenizer.encode("<|im_start|>x", add_special_tokens=False)[0] == tokenizer.convert_tokens_to_ids(
        "<|im_start|>"
    )
    assert model.get_input_embeddings().weight.shape[0] == 288  # 262 tokens, to a multiple of 32
    assert model.config.pad_token_id == tokenizer.pad_token_id
    lora = _axolotl(tmp_path / "lora", special_tokens={"pad_token": "<|pad|>"})
    with pytest.raises(ConfigError, match=r"adds 1 new tokens.*lora_modules_to_save: \[embed_tokens, lm_head\]"):
        _run(tmp_path / "lora", monkeypatch, lora)
    with pytest.raises(ConfigError, match=r"eot_tokens: '<\|eot\|>' is 7 tokens of this tokenizer, not one"):
        _run(tmp_path / "eot", monkeypatch, _axolotl(tmp_path / "eot", eot_tokens=["<|eot|>"]))


def test_val_set_size_holds_out_examples_and_evaluates_at_the_computed_steps(tmp_path, monkeypatch):
    # 40 examples, 4 held out: 36 in rows of 2 are 18 steps an epoch; 3 evaluations an epoch
    # are every 6 steps, 2 checkpoints an epoch every 9.
    config = _axolotl(tmp_path, val_set_size=0.1, evals_per_epoch=3, saves_per_epoch=2, max_steps=12)
    seen, report = _run(tmp_path, monkeypatch, config)
    assert "4 of 40 examples held out for evaluation" in report["notes"]
    assert (seen.args.eval_strategy, seen.args.eval_steps) == ("steps", 6)
    assert [e["step"] for e in report["evaluations"]][:2] == [6, 12]
    assert all(math.isfinite(e["eval_loss"]) for e in report["evaluations"])
    assert (tmp_path / "out" / "checkpoint-9").is_dir()
    counted, report = _run(tmp_path / "n", monkeypatch, _axolotl(tmp_path / "n", val_set_size=5))
    assert "5 of 40 examples held out for evaluation" in report["notes"]
    assert counted.args.eval_steps == 2  # no schedule given: once per epoch, or at the end of a shorter run
    with pytest.raises(ConfigError, match="val_set_size=40 holds out 40 of the 40 examples"):
        _run(tmp_path / "all", monkeypatch, _axolotl(tmp_path / "all", val_set_size=40))


def _per_token_losses(model, batch):
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits.float()
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE)[..., 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none", ignore_index=IGNORE
    ).view(labels.shape)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_batch_has_each_documents_loss_alone(attention):
    model = build_llama("tiny", vocab_size=259, attn_implementation=attention).eval()
    g = torch.Generator().manual_seed(0)
    lengths = [21, 9, 30, 14, 5]
    examples = []
    for n in lengths:
        ids = torch.randint(3, 250, (n,), generator=g).tolist()
        labels = [IGNORE] * (n // 3) + ids[n // 3 :]  # a prompt that is not trained on
        examples.append((ids, labels))
    rows = pack_examples(examples, seq_len=40)
    assert len(rows) < len(examples)  # several documents share a row
    collate = packed_collate(pad_token_id=0, length=40)
    batch = collate(
        [
            {"input_ids": torch.tensor(i), "labels": torch.tensor(lab), "position_ids": torch.tensor(p)}
            for i, lab, p in rows
        ]
    )
    assert "attention_mask" not in batch
    packed = _per_token_losses(model, batch)
    for ids, labels in examples:
        alone = _per_token_losses(model, {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])})[0]
        # Find the document in its row: its tokens, at positions restarting from 0.
        for r, (row_ids, _, positions) in enumerate(rows):
            starts = [k for k, p in enumerate(positions) if p == 0 and row_ids[k : k + len(ids)] == ids]
            if starts:
                k = starts[0]
                torch.testing.assert_close(packed[r, k : k + len(ids)], alone, rtol=1e-5, atol=1e-6)
                assert packed[r, k : k + len(ids)].sum() == pytest.approx(alone.sum().item(), rel=1e-5)
                break
        else:
            raise AssertionError(f"document of {len(ids)} tokens not found in the packed rows")
    # No document predicts the next one's first token, and padding trains nothing.
    for r, (_, _, positions) in enumerate(rows):
        for k, p in enumerate(positions):
            if p == 0:
                assert batch["labels"][r, k] == IGNORE
    assert (batch["labels"][batch["position_ids"] == 0] == IGNORE).all()


def test_sample_packing_trains_packed_rows_or_refuses_a_model_that_mixes_documents(tmp_path, monkeypatch):
    config = _axolotl(tmp_path, sample_packing=True, sequence_len=512, max_steps=2)
    seen, report = _run(tmp_path, monkeypatch, config)
    assert any("40 examples packed into" in n for n in report["notes"])
    model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa")
    assert packing_keeps_documents_apart(model) == (True, "")
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=259, hidden_size=32, num_hidden_layers=2, state_size=4)
    )
    apart, why = packing_keeps_documents_apart(mamba)
    assert not apart and why
    folder = tmp_path / "mamba"
    mamba.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    refused = _axolotl(tmp_path / "m", base_model=str(folder), sample_packing=True, adapter=None)
    refused.pop("model_shape")
    with pytest.raises(
        ConfigError, match=r"sample_packing=true: MambaForCausalLM .* does not keep packed documents apart"
    ):
        _run(tmp_path / "m", monkeypatch, refused)


def test_a_key_that_cannot_be_honoured_is_refused_on_one_line_unless_dropped(tmp_path, monkeypatch, capsys):
    config = _axolotl(tmp_path, cosine_constant_lr_ratio=0.8, wandb_project="x")
    with pytest.raises(ConfigProblemsError) as info:
        TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False)
    message = str(info.value)
    assert "\n" not in message and info.value.unsupported_only
    assert message.startswith("axolotl.yaml: cosine_constant_lr_ratio=0.8: Axolotl's cosine schedule")
    assert "drop_unsupported_keys: true trains without it" in message
    path = tmp_path / "axolotl.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("offloadkit: error:")] == [
        f"offloadkit: error: {path}: " + message.split(": ", 1)[1]
    ]
    assert main(["train", str(path), "--drop-unsupported-keys"]) == 0
    err = capsys.readouterr().err
    assert "drop_unsupported_keys: training without cosine_constant_lr_ratio" in err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any(
        n.startswith("trained without (drop_unsupported_keys): cosine_constant_lr_ratio") for n in report["notes"]
    )


def _fake_cache(tmp_path, monkeypatch, repo="org/tiny-llama"):
    """A Hugging Face cache as the hub library lays it out, with a tiny model in it."""
    cache = tmp_path / "hf-home" / "hub"
    snapshot = cache / ("models--" + repo.replace("/", "--")) / "snapshots" / ("a" * 40)
    build_llama("tiny", vocab_size=259).save_pretrained(snapshot)
    byte_tokenizer().save_pretrained(snapshot)
    (cache / ("models--" + repo.replace("/", "--")) / "refs").mkdir()
    (cache / ("models--" + repo.replace("/", "--")) / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    return snapshot


def test_a_hub_id_trains_from_the_local_cache(tmp_path, monkeypatch, capsys):
    snapshot = _fake_cache(tmp_path, monkeypatch)
    config = _axolotl(tmp_path, base_model="org/tiny-llama")
    config.pop("model_shape")
    _, report = _run(tmp_path, monkeypatch, config)
    assert report["model"] == str(snapshot) and report["steps"] == 2
    path = tmp_path / "hub.yaml"
    path.write_text(yaml.safe_dump(dict(config, output_dir=str(tmp_path / "fresh"))))
    assert main(["check", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{path}: ok"


def test_a_hub_id_neither_cached_nor_downloadable_is_one_line_naming_the_variable(tmp_path, monkeypatch, capsys):
    _fake_cache(tmp_path, monkeypatch)
    config = _axolotl(tmp_path, base_model="org/not-here")
    config.pop("model_shape")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as info:
        _run(tmp_path, monkeypatch, config)
    message = str(info.value)
    assert "base_model='org/not-here' is not in the local Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set; set HF_HOME (or HF_HUB_CACHE)" in message and "\n" not in message

    def no_network(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.snapshot_download", no_network)
    monkeypatch.setattr("offloadkit.integrations.hub.cached_snapshot", lambda repo, revision=None: None)
    with pytest.raises(ConfigError, match=r"could not be downloaded \(OSError: Network is unreachable\); set HF_HOME"):
        _run(tmp_path, monkeypatch, config)
    assert "offloadkit: downloading org/not-here from the Hugging Face Hub into" in capsys.readouterr().err


def test_trust_remote_code_loads_the_models_own_code(tmp_path, monkeypatch):
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tiny_remote'\n"
    )
    (folder / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
        "class TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n"
    )
    model = build_llama("tiny", vocab_size=259)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="tiny_remote",
        architectures=["TinyForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny.TinyConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    keys = _axolotl(tmp_path, base_model=str(folder), trust_remote_code=True)
    keys.pop("model_shape")
    seen, _ = _run(tmp_path, monkeypatch, keys, probe=lambda m: type(m.get_base_model()).__name__)
    assert seen.found == "TinyForCausalLM"
    with pytest.raises(ConfigError, match="could not be loaded"):
        _run(tmp_path / "x", monkeypatch, dict(keys, trust_remote_code=False, output_dir=str(tmp_path / "x")))


def test_unfrozen_parameters_train_only_what_they_name(tmp_path, monkeypatch):
    def trainable(model):
        return sorted(n for n, p in model.named_parameters() if p.requires_grad)

    config = _axolotl(tmp_path, adapter=None, unfrozen_parameters=["^lm_head.weight$", "model.layers.1.mlp"])
    seen, _ = _run(tmp_path, monkeypatch, config, probe=trainable)
    assert seen.found == [
        "lm_head.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
    ]
    with pytest.raises(ConfigError, match=r"matches no parameter of the model \(names like 'base_model.model"):
        _run(tmp_path / "l", monkeypatch, _axolotl(tmp_path / "l", unfrozen_parameters=["^model.language_model.*"]))


def test_loss_watchdog_stops_a_run_whose_loss_stays_high(tmp_path, monkeypatch):
    config = _axolotl(tmp_path, max_steps=6, loss_watchdog_threshold=0.01, loss_watchdog_patience=2)
    seen, report = _run(tmp_path, monkeypatch, config)
    assert report["steps"] == 2 and len(seen.lrs) == 2
    assert any("loss_watchdog_threshold: training stopped at step 2" in n for n in report["notes"])


def test_sampling_order_keys_reach_the_trainer(tmp_path, monkeypatch):
    seen, _ = _run(tmp_path / "g", monkeypatch, _axolotl(tmp_path / "g", group_by_length=True))
    assert seen.args.train_sampling_strategy == "group_by_length"
    seen, _ = _run(tmp_path / "c", monkeypatch, _axolotl(tmp_path / "c", curriculum_sampling=True))
    assert seen.args.train_sampling_strategy == "sequential"


def test_model_config_overrides_and_tokenizer_type(tmp_path, monkeypatch):
    folder = tmp_path / "base"
    build_llama("tiny", vocab_size=259).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    config = _axolotl(
        tmp_path, base_model=str(folder), model_config={"rms_norm_eps": 1e-3}, tokenizer_type="GPT2Tokenizer"
    )
    config.pop("model_shape")
    seen, _ = _run(tmp_path, monkeypatch, config, probe=lambda m: m.get_base_model().config.rms_norm_eps)
    assert seen.found == 1e-3
    saved = json.loads((tmp_path / "out" / "adapter" / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "GPT2Tokenizer"
    with pytest.raises(ConfigError, match="model_config: 'no_such_setting' is not a setting of LlamaConfig"):
        _run(
            tmp_path / "x",
            monkeypatch,
            dict(config, model_config={"no_such_setting": 1}, output_dir=str(tmp_path / "x")),
        )


def test_dataset_split_slices_shards_and_thinking(tmp_path):
    assert split_bounds("train[:1%]", 2000) == (0, 20) and split_bounds("train[10:20]", 100) == (10, 20)
    assert split_bounds("train[-5%:]", 200) == (190, 200) and split_bounds("train", 7) == (0, 7)
    with pytest.raises(ValueError, match="not train or a slice"):
        split_bounds("test", 10)
    tok = byte_tokenizer()
    path = _alpaca(tmp_path / "a.jsonl", n=100)
    first, _ = build_examples(DatasetSpec(path=path, type="alpaca", split="train[:10%]"), tok, 512)
    everything, _ = build_examples(DatasetSpec(path=path, type="alpaca"), tok, 512)
    assert first == everything[:10]
    shard, _ = build_examples(DatasetSpec(path=path, type="alpaca", shards=4, shards_idx=1), tok, 512)
    assert shard == everything[25:50]
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('reasoning_content') %}<think>"
        "{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = tmp_path / "c.jsonl"
    chat.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4", "thinking": "two twos"},
                ]
            }
        )
        + "\n"
    )
    [(ids, labels)], _ = build_examples(
        DatasetSpec(path=str(chat), type="chat_template", field_thinking="thinking"), tok, 512
    )
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])
    assert trained == "<think>two twos</think>4<|im_end|>\n"


def test_axolotl_split_and_turn_keys_map_or_refuse(tmp_path):
    path = _alpaca(tmp_path / "a.jsonl")
    cfg = TrainConfig.from_dict(
        _axolotl(tmp_path, datasets=[{"path": path, "type": "alpaca", "split": "train[:20%]"}]), cuda=False
    )
    assert cfg.dataset_specs()[0].split == "train[:20%]"
    with pytest.raises(ConfigProblemsError, match=r"datasets\[0\].split='test': a split other than train"):
        TrainConfig.from_dict(
            _axolotl(tmp_path, datasets=[{"path": path, "type": "alpaca", "split": "test"}]), cuda=False
        )
    with pytest.raises(ConfigProblemsError, match=r"datasets\[0\].train_on_eos='all'"):
        TrainConfig.from_dict(
            _axolotl(tmp_path, datasets=[{"path": path, "type": "chat_template", "train_on_eos": "all"}]), cuda=False
        )


def test_dedup_and_min_sample_len_drop_examples(tmp_path, monkeypatch):
    path = tmp_path / "dup.jsonl"
    rows = [{"instruction": f"Add {i % 10} and 1.", "input": "", "output": str(i % 10 + 1)} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _axolotl(
        tmp_path, datasets=[{"path": str(path), "type": "alpaca"}], dataset_exact_deduplication=True, min_sample_len=2
    )
    _, report = _run(tmp_path, monkeypatch, config)
    assert "20 repeated examples dropped" in report["notes"]
    with pytest.raises(ConfigError, match="min_sample_len=1000: every example is shorter"):
        _run(tmp_path / "x", monkeypatch, dict(config, min_sample_len=1000, output_dir=str(tmp_path / "x")))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_moe_experts_stores_the_experts_quantized(tmp_path, monkeypatch, bits):
    pytest.importorskip("bitsandbytes")
    from offloadkit.testing.families import build_family

    folder = tmp_path / "moe"
    build_family("qwen3_moe").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    expected = {
        n: p.detach().clone() for n, p in transformers.AutoModelForCausalLM.from_pretrained(folder).named_parameters()
    }

    def experts(model):
        import torch.nn.utils.parametrize as parametrize

        found = {}
        for name, module in model.named_modules():
            if parametrize.is_parametrized(module):
                for param in module.parametrizations:
                    stored = module.parametrizations[param].original
                    found[f"{name}.{param}"] = (stored.dtype, getattr(module, param).detach().clone())
        return found

    config = _axolotl(tmp_path, base_model=str(folder), quantize_moe_experts=True, lora_target_modules=["q_proj"])
    config.pop("model_shape")
    config.pop("lora_target_linear")
    config["load_in_8bit" if bits == 8 else "load_in_4bit"] = True
    seen, report = _run(tmp_path, monkeypatch, config, probe=experts)
    assert len(seen.found) == 4 and report["steps"] == 2  # 2 layers x (gate_up_proj, down_proj)
    for name, (stored, weight) in seen.found.items():
        assert stored == (torch.int8 if bits == 8 else torch.uint8), name
        reference = expected[name.replace("base_model.model.", "")]
        error = (weight - reference).abs().max() / reference.abs().max()
        assert 0 < error < (0.02 if bits == 8 else 0.2), (name, error)  # rounded, not replaced


def test_fractional_warmup_steps_and_a_model_without_the_attention_asked_for(tmp_path, monkeypatch):
    from offloadkit.testing.families import build_family

    seen, _ = _run(tmp_path / "w", monkeypatch, _axolotl(tmp_path / "w", warmup_steps=0.25, max_steps=8))
    assert seen.args.warmup_steps == 0.25 and seen.args.get_warmup_steps(8) == 2  # the Trainer's fraction
    folder = tmp_path / "gemma2"
    build_family("gemma2").save_pretrained(folder)  # soft-capping: eager attention only
    byte_tokenizer().save_pretrained(folder)
    config = _axolotl(tmp_path, base_model=str(folder), attn_implementation="flash_attention_2")
    config.pop("model_shape")
    with pytest.warns(UserWarning, match="Gemma2ForCausalLM has no 'sdpa' attention; it uses its own"):
        seen, report = _run(tmp_path, monkeypatch, config, probe=lambda m: m.config._attn_implementation)
    assert seen.found == "eager" and report["steps"] == 2


def test_lora_on_fused_experts_keeps_dropout_on_the_linear_layers(tmp_path, monkeypatch):
    from offloadkit.testing.families import build_family

    folder = tmp_path / "mixtral"
    build_family("mixtral").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)

    def dropouts(model):
        found = {}
        for module in model.modules():
            if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
                found[type(module).__name__] = type(module.lora_dropout["default"]).__name__
        return found

    keys = _axolotl(tmp_path, base_model=str(folder), lora_dropout=0.1, lora_target_parameters=["experts.down_proj"])
    keys.pop("model_shape")
    seen, report = _run(tmp_path, monkeypatch, keys, probe=dropouts)
    assert seen.found == {"Linear": "Dropout", "ParamWrapper": "Identity"} and report["steps"] == 2
    only = _axolotl(tmp_path / "p", base_model=str(folder), lora_target_parameters=["experts.down_proj"])
    only.pop("model_shape")
    only.pop("lora_target_linear")  # Axolotl adapts only what is named: here the expert parameters
    seen, _ = _run(tmp_path / "p", monkeypatch, only, probe=dropouts)
    assert set(seen.found) == {"ParamWrapper"}


def test_packing_in_order_and_the_last_partial_batch_left_out(tmp_path, monkeypatch):
    examples = [([1] * n, [1] * n) for n in (5, 3, 6, 2, 4)]
    assert [len(ids) for ids, _, _ in pack_examples(examples, 8)] == [8, 8, 4]  # longest first: 6+2, 5+3, 4
    in_order = pack_examples(examples, 8, sequential=True)
    assert [len(ids) for ids, _, _ in in_order] == [8, 8, 4]  # 5+3, 6+2, 4: in the examples' order
    assert [p for _, _, p in in_order][1] == [0, 1, 2, 3, 4, 5, 0, 1]
    config = _axolotl(tmp_path, sample_packing=True, sample_packing_sequentially=True, eval_sample_packing=False)
    cfg = TrainConfig.from_dict(config, cuda=False)
    assert cfg.sample_packing_sequentially and cfg.dataloader_drop_last  # Axolotl drops it in this case
    seen, _ = _run(tmp_path, monkeypatch, config)
    assert seen.args.dataloader_drop_last is True


@pytest.mark.parametrize(
    "kernels, expected",
    [
        ({"lora_mlp_kernel": True, "lora_qkv_kernel": True, "lora_o_kernel": True}, True),
        ({"lora_qkv_kernel": True, "lora_o_kernel": False}, ["q_proj", "k_proj", "v_proj", "qkv_proj"]),
        ({"lora_mlp_kernel": False}, False),
    ],
)
def test_axolotls_lora_kernels_run_offloadkits_fused_lora_path(tmp_path, kernels, expected):
    """lora_*_kernel asks for fused LoRA kernels on those projections: offloadkit's fused path
    on the LoRA layers of those names (all three: every one), trained as written."""
    cfg = TrainConfig.from_dict(_axolotl(tmp_path, **kernels), source="axolotl.yaml", cuda=False)
    assert cfg.offload.fused_lora == expected
    if expected is not False:
        report = run_train(cfg, log=lambda *a: None)
        fused = report["offload"]["fused_lora"]
        assert fused["layers"] == (2 * 7 if expected is True else 2 * 3)
