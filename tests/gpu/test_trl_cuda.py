"""TRL's trainers from the ``trl`` package on the GPU, on real text: ``SFTTrainer`` and
``DPOTrainer`` with offloadkit's mixin against the same trainer without it (losses bitwise,
step by step), and ``SFTTrainer`` with TRL's own ``activation_offloading=True`` beside it.
Eager attention keeps the kernels deterministic, so equality can be asked for."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")

from offloadkit.data import BYTE_VOCAB_SIZE, byte_tokenizer, load_texts  # noqa: E402
from offloadkit.integrations.trainer import ActivationOffloadingMixin  # noqa: E402
from offloadkit.testing import build_llama  # noqa: E402

STEPS = 4
OFFLOAD = {"gradient_checkpointing": True, "activation_offloading": True, "min_offload_size": 0}


def _model():
    torch.manual_seed(0)
    base = build_llama("tiny", vocab_size=BYTE_VOCAB_SIZE, attn_implementation="eager").to("cuda", torch.bfloat16)
    return peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _common(tmp_path, name):
    return {
        "output_dir": str(tmp_path / name),
        "per_device_train_batch_size": 4,
        "max_steps": STEPS,
        "report_to": [],
        "disable_tqdm": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": 0,
        "bf16": True,
        "gradient_checkpointing": True,
    }


def _sft_data():
    text = load_texts()[0]
    return datasets.Dataset.from_dict({"text": [text[i : i + 500] for i in range(0, 16000, 500)]})


def _sft(tmp_path, name, mixin: bool, trl_offloading: bool):
    cls = type("SFT", (ActivationOffloadingMixin, trl.SFTTrainer), {}) if mixin else trl.SFTTrainer
    args = trl.SFTConfig(**_common(tmp_path, name), max_length=256, packing=False, activation_offloading=trl_offloading)
    extra = {"offload_config": OFFLOAD} if mixin else {}
    trainer = cls(model=_model(), args=args, train_dataset=_sft_data(), processing_class=byte_tokenizer(), **extra)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    return trainer


def test_sft_trainer_with_the_mixin_matches_sft_trainer_without(tmp_path):
    plain = _sft(tmp_path, "plain", mixin=False, trl_offloading=False)
    ours = _sft(tmp_path, "ours", mixin=True, trl_offloading=False)
    assert len(_losses(plain)) == STEPS
    assert _losses(ours) == _losses(plain)  # bitwise: the logged floats are the same numbers
    assert ours.offload_report["activations"]["offloaded_bytes"] > 0


def test_sft_trainer_with_trl_offloading_and_the_mixin_runs_one_engine(tmp_path):
    """TRL's flag on alone runs TRL's engine; with the mixin, the mixin switches it off and
    its own engine runs, with the same losses as TRL's step without offloading."""
    plain = _sft(tmp_path, "plain", mixin=False, trl_offloading=False)
    trl_own = _sft(tmp_path, "trl", mixin=False, trl_offloading=True)
    both = _sft(tmp_path, "both", mixin=True, trl_offloading=True)
    assert all(loss == loss for loss in _losses(trl_own)) and len(_losses(trl_own)) == STEPS
    assert both.args.activation_offloading is False
    assert any("TRL's activation_offloading is switched off" in n for n in both.offload_report["notes"])
    assert _losses(both) == _losses(plain)


def _dpo(tmp_path, name, mixin: bool):
    cls = type("DPO", (ActivationOffloadingMixin, trl.DPOTrainer), {}) if mixin else trl.DPOTrainer
    text = load_texts()[0]
    rows = {
        "prompt": [text[i : i + 120] for i in range(0, 3840, 120)],
        "chosen": [text[i + 120 : i + 200] for i in range(0, 3840, 120)],
        "rejected": [text[i + 5000 : i + 5080] for i in range(0, 3840, 120)],
    }
    args = trl.DPOConfig(**_common(tmp_path, name), max_length=256)
    extra = {"offload_config": OFFLOAD} if mixin else {}
    trainer = cls(
        model=_model(),
        args=args,
        train_dataset=datasets.Dataset.from_dict(rows),
        processing_class=byte_tokenizer(),
        **extra,
    )
    trainer.train()
    return trainer


def test_dpo_trainer_with_the_mixin_matches_dpo_trainer_without(tmp_path):
    plain = _dpo(tmp_path, "plain", mixin=False)
    ours = _dpo(tmp_path, "ours", mixin=True)
    assert len(_losses(plain)) == STEPS
    assert _losses(ours) == _losses(plain)
    assert ours.offload_report["activations"]["offloaded_bytes"] > 0
