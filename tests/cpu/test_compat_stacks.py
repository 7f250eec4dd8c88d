"""Stacks around the model: PEFT variants (DoRA, modules_to_save), TRL's DPOTrainer with
offloadkit's mixin (one engine active, TRL's own flag switched off), and offloading every
saved tensor of layers compiled one by one. Offloading is held to bitwise parity."""

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from offloadkit import get_act_offloading_ctx_manager  # noqa: E402
from offloadkit.testing import assert_bitwise_equal, randomize_lora_b, run_step  # noqa: E402
from offloadkit.testing.families import build_family, family_batch  # noqa: E402


def _manager(model):
    return get_act_offloading_ctx_manager(model, warn_if_no_head=False, offload_cpu_tensors=True, min_offload_size=0)


@pytest.mark.parametrize("variant", ["dora", "modules_to_save"])
def test_peft_variants_offload_bitwise(variant):
    model = build_family("llama")
    config = peft.LoraConfig(
        r=4,
        target_modules="all-linear",
        use_dora=variant == "dora",
        modules_to_save=["lm_head"] if variant == "modules_to_save" else None,
    )
    model = randomize_lora_b(peft.get_peft_model(model, config))
    batch = family_batch("llama", model, 40, batch=2)
    ref = run_step(model, batch)
    ctx = _manager(model)
    got = run_step(model, batch, ctx)
    assert ctx.stats.offloaded_tensors > 0
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    if variant == "modules_to_save":
        assert any("modules_to_save" in n and "lm_head" in n for n in got[1])
    else:
        assert any("lora_magnitude_vector" in n for n in got[1])
    ctx.close()


def test_layers_compiled_one_by_one_offload_everything_bitwise():
    """With inductor's CPU kernels (deterministic), offloading every saved tensor of layers
    compiled with layer.compile() is bitwise; the manager's hooks run eagerly."""
    model = build_family("llama")
    for layer in model.model.layers:
        layer.compile()
    batch = family_batch("llama", model, 32, batch=2)
    ref = run_step(model, batch)
    ctx = _manager(model)
    got = run_step(model, batch, ctx)
    again = run_step(model, batch, ctx)  # a second step: no state left behind, no recompile needed
    assert ctx.stats.offloaded_tensors > 0
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert_bitwise_equal(got[1], again[1], "second step")
    ctx.close()
    torch._dynamo.reset()


def test_trl_dpo_trainer_with_the_mixin(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from offloadkit.data import byte_tokenizer
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    class DPO(ActivationOffloadingMixin, trl.DPOTrainer):
        pass

    rows = {
        "prompt": [f"Question {i}: " for i in range(16)],
        "chosen": [f"answer {i}." for i in range(16)],
        "rejected": [f"wrong {i}!" for i in range(16)],
    }
    from offloadkit.data import BYTE_VOCAB_SIZE
    from offloadkit.testing import build_llama

    base = build_llama("tiny", vocab_size=BYTE_VOCAB_SIZE, attn_implementation="sdpa")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear"))
    args = trl.DPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="no",
        max_length=64,
        activation_offloading=True,
    )  # TRL's own engine: the mixin switches it off
    tokenizer = byte_tokenizer()
    trainer = DPO(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict(rows),
        processing_class=tokenizer,
        offload_config={"gradient_checkpointing": True, "activation_offloading": "disk", "disk_dir": str(tmp_path)},
    )
    assert args.activation_offloading is False  # one engine active
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    assert trainer.offload_report["activations"]["offloaded_bytes"] > 0
    assert any("TRL's activation_offloading is switched off" in n for n in trainer.offload_report["notes"])


def test_deepspeed_stage_and_what_is_refused(tmp_path):
    """DeepSpeed's ZeRO stage is read from a dict or a JSON file; layer streaming, whose
    weights DeepSpeed owns, is refused; activation offloading runs (measured on an H100:
    benchmarks/results/deepspeed/)."""
    import json
    from types import SimpleNamespace

    from offloadkit.config import ConfigError, OffloadConfig
    from offloadkit.integrations.trainer import check_deepspeed, deepspeed_zero_stage

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert deepspeed_zero_stage(SimpleNamespace(deepspeed=str(path))) == 3
    assert deepspeed_zero_stage(SimpleNamespace(deepspeed={"zero_optimization": {"stage": 2}})) == 2
    assert deepspeed_zero_stage(SimpleNamespace(deepspeed=None)) is None
    offload = OffloadConfig.from_dict({"gradient_checkpointing": True, "activation_offloading": True})
    assert check_deepspeed(offload, SimpleNamespace(deepspeed=str(path))) is None
    streaming = OffloadConfig.from_dict({"layer_offloading": True})
    with pytest.raises(ConfigError, match="layer_offloading cannot stream weights that DeepSpeed manages"):
        check_deepspeed(streaming, SimpleNamespace(deepspeed={"zero_optimization": {"stage": 2}}))
