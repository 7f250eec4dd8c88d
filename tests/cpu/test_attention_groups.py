"""Attention over groups of key/value heads: the same outputs and gradients as one call
(heads do not interact), the kernel's layout kept, GQA and per-head masks handled, dropout
and unsplittable calls left whole, and remove() restoring the modules."""

import pytest
import torch
import torch.nn.functional as F

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.longctx.attention_groups import apply_attention_head_groups, grouped_attention
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, run_step


def _qkv(hq=8, hkv=4, s=64, d=16, b=2):
    torch.manual_seed(0)
    q = torch.randn(b, hq, s, d, requires_grad=True)
    k = torch.randn(b, hkv, s, d, requires_grad=True)
    v = torch.randn(b, hkv, s, d, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("groups,hq,hkv", [(4, 8, 4), (2, 8, 4), (8, 8, 8), (3, 8, 4)])
def test_grouped_equals_one_call(groups, hq, hkv):
    q, k, v = _qkv(hq, hkv)
    g = torch.randn(2, hq, 64, 16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    out = grouped_attention(groups, q, k, v, is_causal=True, enable_gqa=hq != hkv)
    grads = torch.autograd.grad(out, (q, k, v), g)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_per_head_masks_are_split_and_dropout_runs_whole():
    q, k, v = _qkv(8, 8)
    mask = torch.rand(2, 8, 64, 64) > 0.3
    mask[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(grouped_attention(4, q, k, v, attn_mask=mask), ref, rtol=0, atol=1e-6)
    assert grouped_attention(4, q, k, v, dropout_p=0.1) is None
    assert grouped_attention(4, q[0], k[0], v[0]) is None  # 3-D
    assert grouped_attention(4, *_qkv(8, 4)) is None  # grouped query heads without enable_gqa


def test_outputs_in_the_kernels_layout():
    q, k, v = _qkv(8, 8)
    out = grouped_attention(4, q, k, v, is_causal=True)
    assert out.transpose(1, 2).is_contiguous()


def _model():
    torch.manual_seed(0)
    model = build_llama(
        "tiny", num_hidden_layers=2, attn_implementation="sdpa", num_attention_heads=4, num_key_value_heads=2
    )
    model.config.use_cache = False
    model.train()
    return model


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_model_step_matches_and_remove_restores(checkpointing):
    batch = make_batch(256, 2, 48)
    model = _model()
    ref = run_step(model, batch)
    handle = apply_attention_head_groups(model, 2)
    ckpt = apply_activation_checkpointing(model) if checkpointing else None
    got = run_step(model, batch)
    assert handle.grouped_calls == 2 * (2 if checkpointing else 1)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-6)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-5, atol=1e-6)
    if ckpt is not None:
        ckpt.remove()
    handle.remove()
    assert_bitwise_equal(run_step(model, batch)[1], ref[1], "grads after remove()")
    with pytest.raises(ValueError, match="groups=1"):
        apply_attention_head_groups(model, 1)


def test_forward_wraps_restore_what_the_instance_held():
    """An instance-level forward set before the wrap comes back on remove(); one set by someone
    else after the wrap is left alone."""
    from offloadkit.models.forwards import ForwardWraps

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    own = lambda x: x  # noqa: E731
    a.forward = own
    wraps = ForwardWraps("_test_mark")
    wraps.wrap(a, lambda x: 2 * x)
    wraps.wrap(b, lambda x: 3 * x)
    assert wraps.holds(a) and wraps.holds(b)
    later = lambda x: 4 * x  # noqa: E731
    b.forward = later
    wraps.remove()
    assert a.forward is own and b.forward is later and not wraps.holds(a)


def test_each_groups_kernel_gets_its_gradient_with_its_outputs_strides():
    """Whatever the joined gradient's layout ([B, H, S, D] for [B, S, H, D] outputs, or wider
    rows: a slice of a joined gradient, as a layer hands it back), the group's backward
    receives it with its own output's strides, same values; one with them already passes
    without a copy."""
    from offloadkit.longctx.attention_groups import _GradInOutputLayout

    out = torch.randn(1, 16, 4, 8).transpose(1, 2).requires_grad_()  # [B, H, S, D] in [B, S, H, D] memory
    seen = []
    out.register_hook(lambda g: seen.append(g) or g)
    for grad in (torch.randn(1, 4, 16, 8), torch.randn(1, 16, 12, 8)[:, :, 4:8].transpose(1, 2)):
        seen.clear()
        _GradInOutputLayout.apply(out).backward(grad)
        assert seen[0].stride() == out.stride()
        assert torch.equal(seen[0], grad)
    seen.clear()
    same = torch.randn(1, 16, 4, 8).transpose(1, 2)
    _GradInOutputLayout.apply(out).backward(same)
    assert seen[0].data_ptr() == same.data_ptr()
    # The same addresses with another stride on the size-1 batch dimension: restrided, not copied.
    seen.clear()
    batch = torch.randn(16, 4, 8).as_strided((1, 16, 4, 8), (1, 32, 8, 1)).transpose(1, 2)
    _GradInOutputLayout.apply(out).backward(batch)
    assert seen[0].stride() == out.stride() and seen[0].data_ptr() == batch.data_ptr()
    assert torch.equal(seen[0], batch)


def test_grouped_attention_hands_each_kernel_a_gradient_with_its_outputs_strides(monkeypatch):
    """Through :func:`grouped_attention`: the joined output's gradient, contiguous
    [B, H, S, D] or in [B, S, H, D] memory as a layer hands it back, reaches each group's SDPA
    call with that call's own output strides (a fused backward's graph cache is keyed without
    the gradient's strides)."""
    from offloadkit.longctx import attention_groups

    real = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        out.register_hook(lambda g, o=out: seen.append((g.stride(), o.stride())))
        return out

    monkeypatch.setattr(attention_groups, "SDPA", recording)
    q = torch.randn(1, 16, 8, 4).transpose(1, 2).requires_grad_()  # [B, H, S, D] seen from [B, S, H, D]
    k = torch.randn(1, 16, 4, 4).transpose(1, 2).requires_grad_()
    v = torch.randn(1, 16, 4, 4).transpose(1, 2).requires_grad_()
    for grad in (torch.randn(1, 8, 16, 4), torch.randn(1, 16, 8, 4).transpose(1, 2)):
        seen.clear()
        out = attention_groups.grouped_attention(4, q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)
        assert len(seen) == 4
        assert all(g == o for g, o in seen), seen


def test_groups_still_split_while_ring_attention_has_replaced_the_function(monkeypatch):
    # Ring attention (torch's context parallel) swaps F.scaled_dot_product_attention for a
    # wrapper that calls PyTorch's own function on DTensors: the groups must see that call and
    # call PyTorch's own function per group, not the wrapper again.
    from offloadkit.runtime.ring import SDPA

    outer_calls = []

    def ring_like(*args, **kwargs):
        outer_calls.append(args[0].shape)
        return SDPA(*args, **kwargs)

    model = build_llama("tiny", num_key_value_heads=2, attn_implementation="sdpa")
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    model.zero_grad(set_to_none=True)
    handle = apply_attention_head_groups(model, 2)
    monkeypatch.setattr(F, "scaled_dot_product_attention", ring_like)
    got = run_step(model, batch)
    layers = model.config.num_hidden_layers
    assert handle.grouped_calls == layers, "the replaced function hid the calls from the groups"
    assert len(outer_calls) == layers, "each group went through the replacement again"
    assert_bitwise_equal(ref[0], got[0], "loss")
    handle.remove()
