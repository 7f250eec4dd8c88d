"""A deep copy of a prepared model (a DPO reference, an EMA model, a snapshot for evaluation)
is a model of its own: its forward runs its own weights, whatever offloadkit attached, and the
original runs as before. (Seen: the chunked loss's and the fused LoRA path's forwards, closures
over the original, made the copy compute the original's loss.)"""

import copy
import inspect

import pytest
import torch

from offloadkit.compose import prepare
from offloadkit.testing import build_llama, make_batch, randomize_lora_b

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

CONFIGS = {
    "chunked loss": {"chunked_cross_entropy": True},
    "fused LoRA": {"fused_lora": True},
    "tiled MLP and projections": {"tiled_mlp": True, "tiled_mlp_num_shards": 2, "tiled_projections": True},
    "head groups": {"attention_head_groups": 2},
    "checkpointing with offloading": {"gradient_checkpointing": True, "activation_offloading": True},
    "everything": {
        "chunked_cross_entropy": True,
        "fused_lora": True,
        "tiled_mlp": True,
        "tiled_mlp_num_shards": 2,
        "gradient_checkpointing": True,
        "activation_offloading": True,
    },
}


def _model():
    model = build_llama("tiny", dtype=torch.bfloat16, attn_implementation="sdpa", num_hidden_layers=2)
    model.config.use_cache = False
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    randomize_lora_b(model)
    return model.train()


def _loss(model, batch, runtime=None):
    model.zero_grad(set_to_none=True)
    if runtime is None:
        loss = model(**batch).loss
    else:
        with runtime.context():
            loss = model(**batch).loss
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_deep_copy_runs_its_own_weights(name):
    batch = make_batch(256, 2, 32)
    model = _model()
    runtime = prepare(model, CONFIGS[name])
    try:
        before = _loss(model, batch, runtime)
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in twin.named_parameters():
                if "lora_B" in n:
                    p.zero_()  # the copy's adapters off: its loss is the base model's
        plain = _model()
        with torch.no_grad():
            for n, p in plain.named_parameters():
                if "lora_B" in n:
                    p.zero_()
        assert torch.equal(_loss(twin, batch), _loss(plain, batch)) or torch.allclose(
            _loss(twin, batch), _loss(plain, batch), rtol=1e-2
        )
        assert not torch.equal(_loss(twin, batch), before)
        assert torch.equal(_loss(model, batch, runtime), before)  # the original as it was
    finally:
        runtime.close()


def test_the_chunked_loss_keeps_the_models_signature():
    """The Trainer reads ``model.forward``'s signature to keep the batch's columns."""
    model = _model()
    runtime = prepare(model, {"chunked_cross_entropy": True})
    try:
        base = model.get_base_model()
        assert "labels" in inspect.signature(base.forward).parameters
        assert "input_ids" in inspect.signature(base.forward).parameters
    finally:
        runtime.close()
