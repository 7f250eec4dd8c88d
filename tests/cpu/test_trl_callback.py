"""OffloadCallback on TRL's SFTTrainer with TRL's own ``activation_offloading=True``: given the
trainer, the callback switches TRL's engine off at the start of training and offloads in its
place (one engine, as the mixin does); without it, it refuses to start.

TRL's engine needs an accelerator (its constructor fails on a CPU), so TRL's constructor is
handed a recording stand-in through the factory it calls; the rest is the real SFTTrainer."""

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from offloadkit.config import ConfigError  # noqa: E402
from offloadkit.data import byte_tokenizer, load_texts  # noqa: E402
from offloadkit.integrations.trainer import OffloadCallback  # noqa: E402
from offloadkit.testing import build_llama  # noqa: E402


class RecordingEngine:
    """Stands for TRL's offloading engine: counts the training steps it wraps."""

    def __init__(self):
        self.entered = 0

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc):
        return False


def _sft_with_trls_offloading(tmp_path, monkeypatch):
    import trl.trainer.sft_trainer as sft_trainer

    engine = RecordingEngine()
    monkeypatch.setattr(sft_trainer, "get_act_offloading_ctx_manager", lambda model, **kwargs: engine)
    text = load_texts()[0]
    dataset = datasets.Dataset.from_dict({"text": [text[i : i + 200] for i in range(0, 3200, 200)]})
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        max_length=64,
        logging_steps=1,
        save_strategy="no",
        packing=False,
        activation_offloading=True,
    )
    torch.manual_seed(0)
    model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa")
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=byte_tokenizer())
    assert trainer.maybe_activation_offload_context is engine  # TRL's engine is on
    return trainer, engine


def test_given_the_trainer_the_callback_switches_trls_engine_off(tmp_path, monkeypatch):
    trainer, engine = _sft_with_trls_offloading(tmp_path, monkeypatch)
    callback = OffloadCallback({"activation_offloading": "disk", "disk_dir": str(tmp_path / "acts")}, trainer=trainer)
    trainer.add_callback(callback)
    trainer.train()
    assert trainer.state.global_step == 3
    assert engine.entered == 0, "TRL's engine wrapped training steps beside offloadkit's"
    assert callback.report["activations"]["offloaded_bytes"] > 0  # offloadkit's engine did the offloading


def test_without_the_trainer_the_callback_refuses_to_stack_two_engines(tmp_path, monkeypatch):
    trainer, engine = _sft_with_trls_offloading(tmp_path, monkeypatch)
    callback = OffloadCallback({"activation_offloading": "disk", "disk_dir": str(tmp_path / "acts")})
    trainer.add_callback(callback)
    with pytest.raises(ConfigError, match=r"trainer=trainer.*ActivationOffloadingMixin.*activation_offloading=False"):
        trainer.train()
    assert trainer.state.global_step == 0 and engine.entered == 0  # refused before the first step
    assert callback.runtime is None  # nothing of offloadkit's attached
