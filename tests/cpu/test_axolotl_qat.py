"""Axolotl's ``qat:``: every linear layer trains through torchao's fake quantization (int4
weights in groups with int8 activations, or mxfp4), ``fake_quant_after_n_steps`` switches it
on later, and the saved model has plain linear layers; other formats are refused by name."""

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("torchao")
pytest.importorskip("yaml")

from types import SimpleNamespace  # noqa: E402

from offloadkit.cli.qat import apply_qat, fake_quant_switch  # noqa: E402
from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigError, ConfigProblemsError  # noqa: E402
from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.models.zoo import LLAMA_SHAPES, build_llama  # noqa: E402
from tests.cpu.test_axolotl_keys import _axolotl, _run  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401

INT4 = {"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 32}
SHAPE = dict(LLAMA_SHAPES["tiny"], intermediate_size=128)  # every layer's input a multiple of 32


def _base(tmp_path):
    folder = tmp_path / "base"
    build_llama(SHAPE, vocab_size=259).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


def test_int4_weights_are_rounded_to_16_levels_per_group():
    model = build_llama(SHAPE, vocab_size=259)
    x = torch.randint(3, 250, (1, 12))
    before = model(x).logits
    apply_qat(model, INT4)
    layer = model.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == "FakeQuantizedLinear" and type(model.lm_head).__name__ == "FakeQuantizedLinear"
    rounded = layer.weight_fake_quantizer(layer.weight).detach()
    groups = rounded.reshape(rounded.shape[0], -1, 32)
    assert max(len(torch.unique(g)) for row in groups for g in row) <= 16
    assert not torch.allclose(model(x).logits, before)


def test_fake_quant_after_n_steps_switches_it_on_at_that_step():
    model = build_llama(SHAPE, vocab_size=259)
    apply_qat(model, INT4)
    switch = fake_quant_switch(3)
    layer = model.model.layers[0].mlp.down_proj
    for step, on in ((0, False), (1, False), (3, True)):
        switch.on_step_begin(None, SimpleNamespace(global_step=step), None, model=model)
        assert layer.weight_fake_quantizer.enabled is on and layer.activation_fake_quantizer.enabled is on


@pytest.mark.parametrize(
    "qat",
    [
        dict(INT4, fake_quant_after_n_steps=1),
        {"weight_dtype": "mxfp4", "activation_dtype": "mxfp4"},
        {"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 16},
    ],
)
def test_qat_trains_fake_quantized_and_saves_plain_linear_layers(tmp_path, monkeypatch, qat):
    keys = dict(adapter=None, lora_r=..., lora_alpha=..., lora_target_linear=..., base_model=_base(tmp_path))
    plain = _run(tmp_path / "plain", monkeypatch, _axolotl(tmp_path / "plain", model_shape=..., **keys))[1]
    config = _axolotl(tmp_path / "qat", qat=qat, model_shape=..., **keys)
    seen, report = _run(tmp_path / "qat", monkeypatch, config, probe=lambda m: type(m.lm_head))
    assert seen.found.__name__.endswith("FakeQuantizedLinear")
    assert report["steps"] == 2
    if "fake_quant_after_n_steps" in qat:  # step 1 without the rounding: the same first loss as without QAT
        assert report["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-6)
    else:
        assert report["first_loss"] != pytest.approx(plain["first_loss"], rel=1e-6)
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qat" / "out" / "model")
    assert type(saved.lm_head) is torch.nn.Linear


@pytest.mark.parametrize(
    "qat, keys, match",
    [
        ({"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 32}, {}, r"nvfp4 uses blocks of 16"),
        ({"weight_dtype": "fp8", "activation_dtype": "fp8"}, {}, r"qat=.*weight_dtype='fp8'"),
        (INT4, {"adapter": "lora"}, r"qat=.*drop the adapter"),
        ({"weight_dtype": "mxfp4"}, {"adapter": None}, r"mxfp4 runs with activation_dtype mxfp4"),
    ],
)
def test_qat_it_cannot_run_is_refused(tmp_path, qat, keys, match):
    with pytest.raises(ConfigProblemsError, match=match):
        TrainConfig.from_dict(_axolotl(tmp_path, qat=qat, **keys), source="axolotl.yaml", cuda=False)


def test_a_group_size_the_layers_cannot_take_is_one_line(tmp_path, monkeypatch):
    config = _axolotl(
        tmp_path, qat=dict(INT4, group_size=96), adapter=None, model_shape=..., base_model=_base(tmp_path)
    )
    with pytest.raises(ConfigError, match=r"qat: .* not a multiple of the group size 96"):
        _run(tmp_path, monkeypatch, config)


def test_nvfp4_rounds_both_operands_as_torchao_and_passes_the_gradient_straight_through():
    """The emulated NVFP4 layer multiplies its input and weight as torchao's NVFP4Tensor rounds
    them (blocks of 16 along the input width under a second scale: the weight's of the whole
    tensor, each token's of its own row); the gradients are those of that product."""
    import io

    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    from offloadkit.cli.qat import convert_qat

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=True))
    apply_qat(model, {"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 16})
    layer = model[0]
    assert type(layer).__name__ == "NVFP4FakeQuantizedLinear"
    torch.save(model, io.BytesIO())  # a module-level class: the model pickles
    x = torch.randn(3, 5, 64, requires_grad=True)

    def rounded(rows):
        scale = per_tensor_amax_to_scale(rows.abs().max())
        return NVFP4Tensor.to_nvfp4(rows.contiguous(), per_tensor_scale=scale).dequantize(torch.float32)

    x_q = torch.stack([rounded(row[None])[0] for row in x.detach().reshape(-1, 64)]).reshape(x.shape)
    w_q = rounded(layer.weight.detach())
    assert not torch.equal(x_q, x.detach())
    out = layer(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x_q, w_q, layer.bias), rtol=1e-6, atol=1e-6)
    # A token's rounding is its own: the same with the other tokens of the batch scaled up.
    other = x.detach().clone()
    other[1:] *= 100
    assert torch.equal(layer(other)[0], layer(x)[0].detach())
    # Small activations keep their precision (each row's scale, not the fp8 scale's floor).
    small = torch.randn(8, 64) * 1e-3
    error = (_row_rounded(small) - small).norm() / small.norm()
    assert error < 0.15, error
    grad = torch.randn_like(out)
    out.backward(grad)
    g2 = grad.reshape(-1, 32)
    torch.testing.assert_close(layer.weight.grad, g2.t() @ x_q.reshape(-1, 64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, grad @ w_q, rtol=1e-5, atol=1e-5)
    convert_qat(model)
    assert type(model[0]) is torch.nn.Linear


def _row_rounded(x):
    from offloadkit.cli.qat import _nvfp4_round

    return _nvfp4_round(x, "row")


def test_nvfp4_rounds_an_all_zero_weight_to_zeros_not_nan():
    """A weight that is all zeros (a zero-initialised projection) rounds to zeros: its tensor
    scale is 0 and must not divide."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False))
    torch.nn.init.zeros_(model[0].weight)
    apply_qat(model, {"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 16})
    out = model(torch.randn(2, 32))
    assert torch.equal(out, torch.zeros_like(out))
    from offloadkit.cli.qat import _nvfp4_round

    assert torch.equal(_nvfp4_round(torch.zeros(4, 16), "tensor"), torch.zeros(4, 16))


def test_nvfp4_refuses_a_torchao_without_nvfp4_dequantize_before_training(monkeypatch):
    """torchao before 0.15 has no NVFP4Tensor.dequantize: the run stops when the layers are
    swapped, naming the version, not at its first forward."""
    from torchao.prototype.mx_formats import nvfp4_tensor

    monkeypatch.delattr(nvfp4_tensor.NVFP4Tensor, "dequantize")
    model = torch.nn.Sequential(torch.nn.Linear(32, 16))
    with pytest.raises(ValueError, match=r"nvfp4 needs torchao 0.15 or later"):
        apply_qat(model, {"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 16})
    assert type(model[0]) is torch.nn.Linear
