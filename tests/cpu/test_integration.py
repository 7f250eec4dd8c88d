"""Trainer mixins, callback, TRL, config validation and the CLI, end to end on CPU.

On a CPU machine activation offloading means ``activation_offloading: disk`` (CPU
activations to files), which exercises the whole path for real."""

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offloadkit.config import ConfigError, OffloadConfig  # noqa: E402
from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts  # noqa: E402
from offloadkit.integrations.trainer import (  # noqa: E402
    ActivationOffloadingMixin,
    LayerOffloadingMixin,
    OffloadCallback,
)
from offloadkit.testing import build_llama  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401


class OffloadTrainer(ActivationOffloadingMixin, transformers.Trainer):
    pass


class LossRecorder(transformers.TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=12,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,
        lr_scheduler_type="constant",
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _dataset(seq=64):
    return TokenBlocks(byte_tokenizer(), load_texts(), seq)


def _model(lora=False):
    model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa")
    if lora:
        from offloadkit.integrations.peft_utils import apply_lora

        model = apply_lora(model, rank=4)
    return model


def _train(trainer_cls, tmp_path, lora=False, callbacks=(), **kw):
    torch.manual_seed(0)
    recorder = LossRecorder()
    trainer = trainer_cls(
        model=_model(lora),
        args=_args(tmp_path, **kw.pop("args", {})),
        train_dataset=_dataset(),
        callbacks=[recorder, *callbacks],
        **kw,
    )
    trainer.train()
    return trainer, recorder.losses


@pytest.mark.parametrize("lora", [False, True])
def test_trainer_mixin_losses_equal_plain_trainer_and_go_down(tmp_path, lora):
    _, ref = _train(transformers.Trainer, tmp_path / "plain", lora=lora)
    offload = {"gradient_checkpointing": True, "activation_offloading": "disk", "disk_dir": str(tmp_path)}
    trainer, got = _train(OffloadTrainer, tmp_path / "offload", lora=lora, offload_config=offload)
    assert got == ref, "losses must be identical with offloading"
    assert got[-1] < got[0]
    report = trainer.offload_report
    assert report["activations"]["offloaded_bytes"] > 0
    assert report["storage"]["disk"]["bytes_written"] > 0
    assert trainer.offload_runtime is None  # detached after train()
    assert all("forward" not in m.__dict__ for m in trainer.model.modules())


def test_gradient_accumulation_and_hf_checkpointing(tmp_path):
    args = {"gradient_accumulation_steps": 3, "gradient_checkpointing": True, "max_steps": 6}
    _, ref = _train(transformers.Trainer, tmp_path / "plain", args=args)
    trainer, got = _train(
        OffloadTrainer,
        tmp_path / "offload",
        args=args,
        offload_config={"activation_offloading": "disk", "disk_dir": str(tmp_path)},
    )
    assert got == ref
    assert trainer.offload_config.gradient_checkpointing  # read from the training arguments
    assert trainer.offload_report["checkpointing_active"]
    assert trainer.args.gradient_checkpointing  # the user's arguments are left as they were


def test_callback_route(tmp_path):
    _, ref = _train(transformers.Trainer, tmp_path / "plain")
    callback = OffloadCallback({"activation_offloading": "disk", "disk_dir": str(tmp_path)})
    _, got = _train(transformers.Trainer, tmp_path / "cb", callbacks=[callback])
    assert got == ref
    assert callback.report["activations"]["offloaded_bytes"] > 0 and callback.runtime is None


def test_adapter_saved_and_reloaded_gives_same_outputs(tmp_path):
    peft = pytest.importorskip("peft")
    trainer, _ = _train(
        OffloadTrainer,
        tmp_path / "run",
        lora=True,
        offload_config={"gradient_checkpointing": True, "activation_offloading": "disk", "disk_dir": str(tmp_path)},
    )
    trainer.model.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
    reloaded = peft.PeftModel.from_pretrained(
        build_llama("tiny", vocab_size=259, attn_implementation="sdpa"), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)


def test_trainer_checkpoint_loads_into_ordinary_model(tmp_path):
    trainer, _ = _train(
        OffloadTrainer,
        tmp_path / "run",
        args={"save_strategy": "steps", "save_steps": 12},
        offload_config={"activation_offloading": "disk", "disk_dir": str(tmp_path)},
    )
    checkpoint = tmp_path / "run" / "checkpoint-12"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    for (n, a), (_, b) in zip(trainer.model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_layer_offloading_mixin_warns_on_cpu_and_trains(tmp_path):
    class StreamTrainer(LayerOffloadingMixin, transformers.Trainer):
        pass

    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    with pytest.warns(UserWarning, match="layer_offloading has no effect without a CUDA GPU"):
        _, losses = _train(StreamTrainer, tmp_path, lora=True)
    assert losses[-1] < losses[0]


def test_trl_sft_trainer_with_mixin(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    class SFT(ActivationOffloadingMixin, trl.SFTTrainer):
        pass

    text = load_texts()[0]
    ds = datasets.Dataset.from_dict({"text": [text[i : i + 200] for i in range(0, 8000, 200)]})
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        max_length=64,
        logging_steps=1,
        save_strategy="no",
        packing=False,
    )
    trainer = SFT(
        model=_model(lora=True),
        args=args,
        train_dataset=ds,
        processing_class=byte_tokenizer(),
        offload_config={"gradient_checkpointing": True, "activation_offloading": "disk", "disk_dir": str(tmp_path)},
    )
    trainer.train()
    assert trainer.offload_report["activations"]["offloaded_bytes"] > 0


@pytest.mark.parametrize(
    "data, message",
    [
        ({"activation_offlaoding": True}, "unknown key 'activation_offlaoding'.*did you mean 'activation_offloading'"),
        ({"activation_offloading": "fast"}, "activation_offloading='fast' is not a mode"),
        ({"gradient_checkpointing": 1}, "gradient_checkpointing=1 has the wrong type"),
        ({"activation_loading_horizon": -1}, "activation_loading_horizon=-1 is too small"),
        ({"max_fwd_stash_size": 0}, "max_fwd_stash_size=0 is too small"),
        ({"host_budget_bytes": "twelve"}, "host_budget_bytes='twelve' is not a size"),
        ({"host_budget_bytes": -5}, "host_budget_bytes=-5 must be positive"),
        ({"direct_io": "maybe"}, "direct_io='maybe' is invalid"),
        ({"selective_checkpointing": ["mm"]}, "selective_checkpointing needs gradient_checkpointing"),
        ({"gradient_checkpointing": True, "selective_checkpointing": ["convs"]}, "unknown op groups"),
        ({"activation_offloading": "disk", "disk_tiering": True}, "disk_tiering: true needs host_budget_bytes"),
        ({"disk_tiering": True, "host_budget_bytes": "1GiB"}, "disk_tiering: true needs activation_offloading: disk"),
    ],
)
def test_config_errors_name_key_value_and_fix(data, message):
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict(data)


def test_config_aliases_units_and_warnings(tmp_path):
    cfg = OffloadConfig.from_dict(
        {"sm_activation_offloading": True, "activation_loading_horizon": 3, "host_budget_bytes": "1.5GiB"}
    )
    assert cfg.activation_offloading is True and cfg.host_budget_bytes == int(1.5 * 2**30)
    with pytest.warns(UserWarning, match="disk_dir only apply with activation_offloading: disk"):
        OffloadConfig.from_dict({"activation_offloading": True, "disk_dir": "/tmp"})
    (tmp_path / "c.yaml").write_text("activation_offloading: legacy\nactivation_loading_horizon: 4\n")
    assert OffloadConfig.from_file(str(tmp_path / "c.yaml")).activation_offloading == "legacy"
    (tmp_path / "c.json").write_text(json.dumps({"layer_offloading": True}))
    assert OffloadConfig.from_file(str(tmp_path / "c.json")).layer_offloading is True
    (tmp_path / "bad.yaml").write_text("activation_offloading: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML at line"):
        OffloadConfig.from_file(str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match="does not exist"):
        OffloadConfig.from_file(str(tmp_path / "missing.yaml"))


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args, cwd=None):
    # The package under test, whatever the working directory of the command.
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, "-m", "offloadkit", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )


def test_cli_train_end_to_end_writes_report_plot_and_adapter(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model_shape: tiny\nseq_len: 64\nbatch_size: 4\nmax_steps: 8\nlogging_steps: 2\n"
        f"lora_rank: 4\noutput_dir: {tmp_path / 'out'}\ngradient_checkpointing: true\n"
        f"activation_offloading: disk\ndisk_dir: {tmp_path}\nprofile_step: 2\n"
    )
    proc = _cli("train", str(config))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 8 and report["offloaded"]["activations_to_disk_bytes_per_step"] > 0
    assert report["losses"][-1][1] < report["losses"][0][1]
    assert (out / "memory_timeline.png").stat().st_size > 10_000
    assert (out / "adapter" / "adapter_config.json").exists()
    assert "where the memory went" in proc.stdout


@pytest.mark.parametrize(
    "content, message",
    [
        ("activation_offloding: true\n", "unknown key 'activation_offloding'"),
        ("seq_len: [1\n", "invalid YAML"),
        ("model: /no/such/model\n", "is not a directory"),
        ("dataset: /no/such/file.txt\n", "does not exist"),
        ("max_steps: 0\n", "max_steps=0 must be an integer >= 1"),
    ],
)
def test_cli_user_mistakes_are_one_line_errors(tmp_path, content, message):
    config = tmp_path / "bad.yaml"
    config.write_text(f"{content}output_dir: {tmp_path / 'out'}\n")
    proc = _cli("train", str(config))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("offloadkit: error:") and message in lines[0], proc.stderr


def test_cli_missing_config_file_and_help(tmp_path):
    proc = _cli("train", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    for args in (("--help",), ("train", "--help"), ("bench", "--help"), ("demo", "--help")):
        proc = _cli(*args)
        assert proc.returncode == 0 and "usage: offloadkit" in proc.stdout
    assert "activation_offloading" in _cli("train", "--help").stdout


def test_cli_bench_on_cpu(tmp_path):
    proc = _cli(
        "bench",
        "--shape",
        "tiny",
        "--seq-len",
        "64",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--modes",
        "none;ckpt;ok_ckpt",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "tiny-64.json").read_text())
    assert [r["mode"] for r in report["results"]] == ["none", "ckpt", "ok_ckpt"]
    assert all(r["loss_bits_equal_reference"] for r in report["results"])
    assert (tmp_path / "tiny-64.png").exists()


def test_budget_keys_reach_the_runtime(tmp_path):
    from offloadkit.compose import prepare

    cfg = OffloadConfig.from_dict(
        {
            "activation_offloading": "disk",
            "disk_dir": str(tmp_path),
            "host_budget_bytes": "64MiB",
            "host_min_free_bytes": "1GiB",
        }
    )
    runtime = prepare(_model(), cfg)
    assert runtime.manager.budget.limit_bytes == 64 << 20
    assert runtime.manager.budget.min_free_bytes == 1 << 30
    assert runtime.manager.prefetch == 4  # disk storage: deeper default horizon
    runtime.close()
    ram = prepare(_model(), OffloadConfig.from_dict({"activation_offloading": "legacy"}))
    if ram.manager is not None:
        assert ram.manager.prefetch == 2
    ram.close()


def test_cli_train_local_model_directory_and_jsonl(tmp_path):
    model_dir = tmp_path / "my-model"
    build_llama("tiny", vocab_size=259).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    text = load_texts()[0]
    data.write_text("\n".join(json.dumps({"body": text[i : i + 600]}) for i in range(0, 12000, 600)) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {model_dir}\ndataset: {data}\ntext_field: body\nseq_len: 32\nbatch_size: 2\n"
        f"max_steps: 4\nlora_rank: 0\noutput_dir: {tmp_path / 'out'}\n"
        f"activation_offloading: disk\ndisk_dir: {tmp_path}\n"
    )
    proc = _cli("train", str(config))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["steps"] == 4 and report["offloaded"]["activations_to_disk_bytes_per_step"] > 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")  # full fine-tune saved
    assert reloaded.config.vocab_size == 259
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        f"model: {model_dir}\ndataset: {data}\ntext_field: text\nmax_steps: 1\nseq_len: 32\n"
        f"output_dir: {tmp_path / 'bad-out'}\n"
    )
    proc = _cli("train", str(bad))
    assert proc.returncode == 2 and "no 'text' field" in proc.stderr
