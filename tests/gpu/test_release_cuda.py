"""A closed runtime gives its device memory back: after ``close()`` and the last reference to
the model, nothing it allocated (on the compute stream or on a copy stream) stays allocated.
A run that leaks here leaks once per ``train()``, per evaluation runtime, per test."""

import gc

import pytest
import torch

from offloadkit.compose import prepare
from offloadkit.testing import build_llama, make_batch, randomize_lora_b

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
peft = pytest.importorskip("peft")

CONFIGS = {
    "checkpoint inputs offloaded": {"gradient_checkpointing": True, "activation_offloading": True},
    "every saved tensor offloaded": {"activation_offloading": True},
    "synchronous offload": {"activation_offloading": "legacy"},
    "with layer streaming": {"gradient_checkpointing": True, "activation_offloading": True, "layer_offloading": True},
    "attention outputs kept": {
        "gradient_checkpointing": True,
        "activation_offloading": True,
        "keep_attention_outputs": True,
    },
}


def _active_by_stream() -> dict[int, int]:
    out: dict[int, int] = {}
    for seg in torch.cuda.memory_snapshot():
        live = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        if live:
            out[seg["stream"]] = out.get(seg["stream"], 0) + live
    return out


def _settle() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_closed_runtime_leaves_nothing_allocated(name):
    _settle()
    before_bytes, before_streams = torch.cuda.memory_allocated(), _active_by_stream()
    model = build_llama("small", dtype=torch.bfloat16, device="cuda", num_hidden_layers=4, attn_implementation="sdpa")
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    randomize_lora_b(model)
    model.train()
    runtime = prepare(model, CONFIGS[name])
    batch = make_batch(2048, 2, 512, device="cuda")
    for _ in range(2):
        with runtime.context():
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    runtime.close()
    del model, runtime, loss, batch
    _settle()
    grown = {s: n - before_streams.get(s, 0) for s, n in _active_by_stream().items() if n > before_streams.get(s, 0)}
    # Not equal: an earlier test's leftovers may be collected meanwhile (seen: 86 MB of 2.2 GB).
    assert torch.cuda.memory_allocated() <= before_bytes and not grown, (
        f"{torch.cuda.memory_allocated() - before_bytes} bytes more allocated, by stream: {grown}"
    )
