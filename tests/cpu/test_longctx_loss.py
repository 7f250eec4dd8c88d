"""Chunked cross-entropy against the unchunked loss (``F.linear`` + ``F.cross_entropy``
with Hugging Face's label shift and normalisation).

Tolerances, relative to the largest reference value of each tensor: fp64 1e-10 and fp32
1e-5 (the same maths; only summation order differs); bf16: the chunked result must be no
further from an fp64 reference than 1.5 times the unchunked bf16 result is, plus 1e-4
(both round the logits and the head's matmuls to bf16; the chunked path accumulates the
weight gradient over chunks in fp32).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from offloadkit import chunked_cross_entropy
from offloadkit.longctx.loss import auto_chunk_tokens
from offloadkit.testing import AllocationTracker, SavedTensorTracker

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def reference(h, w, labels, b=None, *, num_items=None, ignore=-100, shift=True, scale=None, softcap=None):
    logits = F.linear(h, w, b)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if scale is not None:
        logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore)[..., 1:]
    reduction = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, w.shape[0]), labels.reshape(-1), ignore_index=ignore, reduction=reduction)
    return loss if num_items is None else loss / num_items


def close(got, ref, tol, what=""):
    assert got is not None and ref is not None, what
    scale = ref.abs().max().item() or 1.0
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]


def grads(*tensors):
    return [None if t is None else t.grad for t in tensors]


def problem(dtype, batch=2, seq=37, hidden=16, vocab=50, bias=True, head_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / math.sqrt(hidden)).to(dtype)
    w.requires_grad_(head_grad)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :20] = -100  # with 7 chunks of 11 tokens, the first chunk is all ignored
    labels[1, 5] = -100
    return h, w, b, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunks", [1, 3, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_parity_full_precision(dtype, chunks, bias):
    h, w, b, labels = problem(dtype, bias=bias)
    ref_in, got_in = leaves(h, w, b), leaves(h, w, b)
    ref = reference(*ref_in[:2], labels, ref_in[2])
    ref.backward()
    got = chunked_cross_entropy(got_in[0], got_in[1], labels, got_in[2], num_chunks=chunks)
    got.backward()
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    close(got, ref, TOL[dtype], "loss")
    for name, a, r in zip(("hidden", "weight", "bias"), grads(*got_in), grads(*ref_in)):
        if r is not None:
            close(a, r, TOL[dtype], name)


def test_bf16_no_worse_than_unchunked():
    h, w, b, labels = problem(torch.float64, seq=96, hidden=64, vocab=512)
    exact_in = leaves(h, w, b)
    exact = reference(*exact_in[:2], labels, exact_in[2])
    exact.backward()
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in (h, w, b)]
    ref_in, got_in = leaves(*low), leaves(*low)
    ref = reference(*ref_in[:2], labels, ref_in[2])
    ref.backward()
    got = chunked_cross_entropy(got_in[0], got_in[1], labels, got_in[2], num_chunks=5)
    got.backward()
    pairs = [("loss", got, ref, exact)] + list(
        zip(("hidden", "weight", "bias"), grads(*got_in), grads(*ref_in), grads(*exact_in))
    )
    for name, g, r, e in pairs:
        scale = e.abs().max().item()
        err_got = (g.double() - e).abs().max().item() / scale
        err_ref = (r.double() - e).abs().max().item() / scale
        assert err_got <= 1.5 * err_ref + 1e-4, f"{name}: chunked {err_got:.2e} vs unchunked {err_ref:.2e}"


def test_num_items_in_batch_and_gradient_accumulation():
    """Two micro-batches normalised by the tokens of both, grads added to existing .grad."""
    h1, w, b, l1 = problem(torch.float64, seed=1)
    h2, _, _, l2 = problem(torch.float64, seed=2)
    l2[1, :30] = -100
    n_items = int(sum((F.pad(lab, (0, 1), value=-100)[..., 1:] != -100).sum() for lab in (l1, l2)))
    ref_in, got_in = leaves(h1, h2, w, b), leaves(h1, h2, w, b)
    for t in (ref_in[2], got_in[2]):
        t.grad = torch.ones_like(t)  # accumulation must add to what is there
    for i, lab in enumerate((l1, l2)):
        reference(ref_in[i], ref_in[2], lab, ref_in[3], num_items=n_items).backward()
        items = n_items if i == 0 else torch.tensor(n_items)
        chunked_cross_entropy(got_in[i], got_in[2], lab, got_in[3], num_chunks=4, num_items_in_batch=items).backward()
    for name, a, r in zip(("h1", "h2", "weight", "bias"), grads(*got_in), grads(*ref_in)):
        close(a, r, TOL[torch.float64], name)


def test_frozen_head_computes_no_weight_gradient():
    h, w, b, labels = problem(torch.float32, vocab=300, bias=False, head_grad=False)
    vocab, hidden = w.shape
    with AllocationTracker() as frozen:
        chunked_cross_entropy(h, w, labels, num_chunks=3).backward()
    assert w.grad is None
    assert not [r for r in frozen.records if r[1] == (vocab, hidden)], "a weight gradient was computed"
    ref_h = h.detach().clone().requires_grad_()
    reference(ref_h, w, labels).backward()
    close(h.grad, ref_h.grad, TOL[torch.float32], "hidden")
    w.requires_grad_(True)  # control: a trainable head does allocate its gradient
    with AllocationTracker() as trainable:
        chunked_cross_entropy(h, w, labels, num_chunks=3).backward()
    assert [r for r in trainable.records if r[1] == (vocab, hidden)]


def test_tied_head_gets_embedding_and_head_gradient():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(64, 16).double()
    proj = torch.nn.Linear(16, 16).double()
    ids = torch.randint(0, 64, (2, 23))

    def run(loss_fn):
        emb.zero_grad(set_to_none=True)
        proj.zero_grad(set_to_none=True)
        hidden = torch.tanh(proj(emb(ids)))
        loss_fn(hidden, emb.weight, ids).backward()
        return emb.weight.grad.clone(), proj.weight.grad.clone()

    ref = run(lambda hd, w, lab: reference(hd, w, lab))
    got = run(lambda hd, w, lab: chunked_cross_entropy(hd, w, lab, num_chunks=5))
    close(got[0], ref[0], TOL[torch.float64], "tied weight")
    close(got[1], ref[1], TOL[torch.float64], "upstream weight")


def test_all_ignored_gives_nan_loss_and_zero_grads_like_reference():
    h, w, b, labels = problem(torch.float32)
    labels[:] = -100
    ref_in, got_in = leaves(h, w, b), leaves(h, w, b)
    ref = reference(*ref_in[:2], labels, ref_in[2])
    ref.backward()
    got = chunked_cross_entropy(got_in[0], got_in[1], labels, got_in[2], num_chunks=3)
    got.backward()
    assert torch.isnan(ref) and torch.isnan(got)
    for a, r in zip(grads(*got_in), grads(*ref_in)):
        assert torch.equal(a, r) and not a.any()


def test_shift_options_and_custom_ignore_index():
    h, w, b, labels = problem(torch.float64)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    a = chunked_cross_entropy(h, w, labels, b, num_chunks=2)
    close(chunked_cross_entropy(h, w, shifted, b, shift=False), a, TOL[torch.float64], "shift=False")
    close(chunked_cross_entropy(h, w, None, b, shift_labels=shifted), a, TOL[torch.float64], "shift_labels")
    custom = torch.where(labels == -100, 7, labels)
    custom[custom == 7] = 7
    got = chunked_cross_entropy(h, w, custom, b, ignore_index=7, num_chunks=3)
    close(got, reference(h, w, custom, b, ignore=7), TOL[torch.float64], "ignore_index=7")


@pytest.mark.parametrize("scale, softcap", [(0.0625, None), (None, 3.0), (2.5, 1.5)])
def test_logit_scale_and_softcapping(scale, softcap):
    h, w, b, labels = problem(torch.float64)
    ref_in, got_in = leaves(h, w, b), leaves(h, w, b)
    ref = reference(*ref_in[:2], labels, ref_in[2], scale=scale, softcap=softcap)
    ref.backward()
    got = chunked_cross_entropy(
        got_in[0], got_in[1], labels, got_in[2], num_chunks=3, logit_scale=scale, final_logit_softcapping=softcap
    )
    got.backward()
    close(got, ref, TOL[torch.float64], "loss")
    for name, a, r in zip(("hidden", "weight", "bias"), grads(*got_in), grads(*ref_in)):
        close(a, r, TOL[torch.float64], name)


def test_upstream_gradient_retain_graph_and_no_grad():
    h, w, b, labels = problem(torch.float64)
    ref_in, got_in = leaves(h, w, b), leaves(h, w, b)
    ref = reference(*ref_in[:2], labels, ref_in[2])
    (3 * ref).backward(retain_graph=True)
    ref.backward()
    got = chunked_cross_entropy(got_in[0], got_in[1], labels, got_in[2], num_chunks=3)
    (3 * got).backward(retain_graph=True)
    got.backward()
    for a, r in zip(grads(*got_in), grads(*ref_in)):
        close(a, r, TOL[torch.float64])
    with torch.no_grad(), AllocationTracker() as t:
        loss = chunked_cross_entropy(h, w, labels, b, num_chunks=3)
    close(loss, ref.detach(), TOL[torch.float64], "no_grad loss")
    n_tokens = labels.numel()
    assert not [r for r in t.records if r[1] == (n_tokens, h.shape[-1])], "no gradient buffers without grad"


def test_never_allocates_or_saves_full_logits():
    batch, seq, hidden, vocab = 2, 256, 32, 1024
    h, w, b, labels = problem(torch.float32, batch=batch, seq=seq, hidden=hidden, vocab=vocab, bias=False)
    full = batch * seq * vocab
    with AllocationTracker() as alloc, SavedTensorTracker() as saved:
        chunked_cross_entropy(h, w, labels, num_chunks=8).backward()
    assert alloc.max_elements <= full // 8, alloc.shapes_over(full // 8 + 1)
    assert saved.max_elements <= vocab * hidden, saved.shapes
    with AllocationTracker() as control:
        reference(h, w, labels).backward()
    assert control.max_elements >= full  # the observable does see full logits


def test_autocast_matches_unchunked_autocast():
    h, w, b, labels = problem(torch.float32, seq=64, hidden=32, vocab=256)
    ref_in, got_in = leaves(h, w, b), leaves(h, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference(*ref_in[:2], labels, ref_in[2])
        got = chunked_cross_entropy(got_in[0], got_in[1], labels, got_in[2], num_chunks=3)
    ref.backward()
    got.backward()
    assert got.dtype == torch.float32
    close(got, ref, 1e-2, "loss")
    for name, a, r in zip(("hidden", "weight", "bias"), grads(*got_in), grads(*ref_in)):
        assert a.dtype == r.dtype == torch.float32
        close(a, r, 2e-2, name)


def test_chunk_rule_and_argument_errors():
    assert auto_chunk_tokens(128256) == 2092 and 2092 * 128256 <= 2**28 < 2093 * 128256
    assert auto_chunk_tokens(256) == 2**20
    h, w, b, labels = problem(torch.float32)
    with pytest.raises(ValueError, match="num_chunks=0"):
        chunked_cross_entropy(h, w, labels, num_chunks=0)
    with pytest.raises(ValueError, match="not both"):
        chunked_cross_entropy(h, w, labels, num_chunks=2, chunk_tokens=8)
    with pytest.raises(ValueError, match="does not match"):
        chunked_cross_entropy(h, w.t(), labels)
    with pytest.raises(ValueError, match="float64"):
        chunked_cross_entropy(h, w.double(), labels)
    big_h, big_w = torch.zeros(1, 20000, 1), torch.zeros(128256, 1)
    with pytest.raises(ValueError, match="over 2\\*\\*31"):
        chunked_cross_entropy(big_h, big_w, torch.zeros(1, 20000, dtype=torch.long), num_chunks=1)
    tokens = torch.randint(0, 5, (1, 20000))
    small = chunked_cross_entropy(torch.randn(1, 20000, 4), torch.randn(5, 4), tokens, chunk_tokens=4096)
    assert torch.isfinite(small)


def _fp16_scaled_errors(chunked: bool, hidden_dtype, scale=65536.0, softcap=None, bias=False):
    """Relative errors of the hidden and head gradients, under autocast fp16 with a loss
    scale as GradScaler applies it, against an fp64 reference."""
    g = torch.Generator().manual_seed(3)
    n, hidden, vocab = 4096, 64, 4096
    h64 = torch.randn(n, hidden, generator=g, dtype=torch.float64) * 2
    w64 = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.05
    b64 = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.1 if bias else None
    labels = torch.randint(0, vocab, (n,), generator=g)
    ref_h, ref_w = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    reference(ref_h, ref_w, labels, b64, softcap=softcap).backward()
    h = h64.to(hidden_dtype).requires_grad_()
    w = w64.float().requires_grad_()
    b = None if b64 is None else b64.float()
    with torch.autocast("cpu", dtype=torch.float16):
        if chunked:
            loss = chunked_cross_entropy(h, w, labels, b, num_chunks=4, final_logit_softcapping=softcap)
        else:
            logits = F.linear(h, w, b).float()
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            loss = F.cross_entropy(logits[:-1], labels[1:])
    (loss * scale).backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    err = [
        float((got.double() / scale - ref.grad).norm() / ref.grad.norm())
        for got, ref in ((h.grad, ref_h), (w.grad, ref_w))
    ]
    return err


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_fp16_with_loss_scale_as_accurate_as_unchunked(hidden_dtype, softcap):
    # fp32 hidden states: the Trainer's fp16=True over fp32 weights; fp16 hidden states: an
    # fp16-loaded base (QLoRA's fp16 compute). Folding 1/N into an fp16 gradient in forward
    # gave 1e-2 errors, and fp16 gradients times the scale 65536 gave inf.
    plain = _fp16_scaled_errors(False, hidden_dtype, softcap=softcap)
    chunked = _fp16_scaled_errors(True, hidden_dtype, softcap=softcap)
    for got, want in zip(chunked, plain):
        assert got <= 1.5 * want + 1e-5, (chunked, plain)


def test_fp16_deferred_gradients_keep_bias_and_upstream_scale():
    h, w, b, labels = problem(torch.float16, bias=True)
    h32, w32, b32 = (t.detach().float().requires_grad_() for t in (h, w, b))
    h16, w16, b16 = leaves(h, w, b)
    (chunked_cross_entropy(h16, w16, labels, b16, num_chunks=3) * 1024).backward()
    (reference(h32, w32, labels, b32) * 1024).backward()
    for got, ref, what in (
        (h16.grad, h32.grad, "hidden"),
        (w16.grad, w32.grad, "weight"),
        (b16.grad, b32.grad, "bias"),
    ):
        assert got.dtype == torch.float16 and torch.isfinite(got).all(), what
        close(got.float(), ref, 2e-2, what)


def test_negative_label_other_than_ignore_index_raises_like_torch():
    h, w, b, labels = problem(torch.float32)
    labels[1, 5] = -1
    with pytest.raises(IndexError, match="Target -1 is out of bounds"):
        F.cross_entropy(F.linear(h, w, b).reshape(-1, w.shape[0]), labels.reshape(-1))
    with pytest.raises(IndexError, match="Target -1 is out of bounds"):
        chunked_cross_entropy(h, w, labels, b)
    labels[1, 5] = w.shape[0]
    with pytest.raises(IndexError, match=f"Target {w.shape[0]} is out of bounds"):
        chunked_cross_entropy(h, w, labels, b)
