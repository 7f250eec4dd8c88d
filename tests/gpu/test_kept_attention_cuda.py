"""CUDA tests of attention outputs kept for the recompute: SDPA's cuDNN, flash and efficient
kernels, bf16 gradients bitwise those of the full recompute, the kernel run once per layer,
a late host->device copy waited for, and no higher peak.

Run with ``pytest -m gpu``; skipped without CUDA.
"""

import gc

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.checkpointing.attention import KeptAttention
from offloadkit.runtime.attention_ops import LARGE_OUTPUTS, AttentionCalls
from offloadkit.testing import (
    assert_bitwise_equal,
    build_llama,
    make_batch,
    randomize_lora_b,
)
from offloadkit.transfer.streams import copy_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("clean_cuda"),
]

DEV = "cuda"
LAYERS = 3
BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


@pytest.fixture
def replay_checked(monkeypatch):
    """Each replayed call also runs the kernel: the bytes handed to autograd must be the
    kernel's own, bit for bit (the exactness claim itself, free of backward's atomics)."""
    checked = []
    replay = KeptAttention._replay

    def checking(self, op, args, kwargs, run):
        out = replay(self, op, args, kwargs, run)
        if self._next <= len(self._kept) and self._kept[self._next - 1].key is not None:
            again = run()
            for i in LARGE_OUTPUTS:
                assert_bitwise_equal(out[i], again[i], f"{op} output {i}")
            checked.append(op)
        return out

    monkeypatch.setattr(KeptAttention, "_replay", checking)
    return checked


def _model(kv_heads: int = 4):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = build_llama(
        "small",
        dtype=torch.bfloat16,
        device=DEV,
        attn_implementation="sdpa",
        num_hidden_layers=LAYERS,
        num_key_value_heads=kv_heads,
    )
    model.config.use_cache = False
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    randomize_lora_b(model)
    model.train()
    return model


class _Count:
    def __init__(self):
        self.runs = 0

    def __call__(self, op, args, kwargs, run):
        self.runs += 1
        return run()


def _step(keep, backend, batch, kv_heads, before_backward=None):
    model = _model(kv_heads)
    handle = apply_activation_checkpointing(model, offload_inputs=True, keep_attention=keep)
    counter = _Count()
    chooser = sdpa_kernel([BACKENDS[backend]]) if BACKENDS[backend] is not None else torch.enable_grad()
    with chooser, AttentionCalls(counter):
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        if before_backward is not None:
            before_backward()
        out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    stats = handle.attention_stats
    handle.remove()
    return out.loss.detach(), grads, counter.runs, stats


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_kept_attention_is_the_kernels_bytes(backend, replay_checked):
    """The replayed outputs are the kernel's own bytes (checked on every replayed call), the
    loss is bitwise the same, and the kernel runs once per layer. The gradients are compared
    with the attention backward's own spread: its query gradient is accumulated with atomics,
    so two runs of the full recompute differ in the last bits too (the CPU suite, whose
    kernel reproduces itself, asserts bitwise gradients)."""
    # The efficient kernel takes no grouped keys: give it as many key/value heads as heads.
    kv_heads = 8 if backend == "efficient" else 4
    batch = make_batch(2048, 1, 4096, device=DEV)
    loss, grads, runs, _ = _step(False, backend, batch, kv_heads)
    kept_loss, kept_grads, kept_runs, stats = _step(True, backend, batch, kv_heads)
    assert_bitwise_equal(loss, kept_loss, "loss")
    assert len(replay_checked) == LAYERS
    # The replay check runs each kernel once more, seen by the counter.
    assert runs == 2 * LAYERS and kept_runs - len(replay_checked) == LAYERS, (runs, kept_runs)
    assert stats.kept == LAYERS and stats.replayed == LAYERS and stats.ran_again == 0
    for name, ref in grads.items():
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(kept_grads[name], ref, rtol=0, atol=2e-2 * scale + 1e-12, msg=name)


def test_a_late_copy_back_is_waited_for(replay_checked):
    """The host->device copy stream is held back by a long kernel before backward: the
    recompute must wait for the bytes, not read the buffer while they are on their way."""
    batch = make_batch(2048, 1, 4096, device=DEV)
    ref = _step(False, "default", batch, 4)
    stall = lambda: _sleep_on(copy_stream(torch.device(DEV), "h2d"))  # noqa: E731
    got = _step(True, "default", batch, 4, before_backward=stall)
    assert_bitwise_equal(ref[0], got[0], "loss")
    for name, g in ref[1].items():
        scale = g.float().abs().max().item()
        torch.testing.assert_close(got[1][name], g, rtol=0, atol=2e-2 * scale + 1e-12, msg=name)
    assert got[3].replayed == LAYERS and len(replay_checked) == LAYERS


def _sleep_on(stream):
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the copy stream before any copy back


def test_keeping_does_not_raise_the_peak():
    """The kept outputs arrive as each layer's recompute starts, in place of the kernel's: the
    step's peak stays within one attention output of the plain one."""
    batch = make_batch(2048, 1, 16384, device=DEV)
    peaks = {}
    for keep in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(keep, "default", batch, 4)
        peaks[keep] = torch.cuda.max_memory_allocated() - base
    one_output = 16384 * 256 * 2
    assert peaks[True] <= peaks[False] + one_output, peaks
