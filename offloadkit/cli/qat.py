"""Quantization-aware training (Axolotl's ``qat:``) with torchao's fake quantization.

Every linear layer of the model (the output head included) computes with its weights, and its
inputs, rounded to the target format on the forward pass, while the weights train in full
precision (the gradient passes the rounding unchanged). Two of Axolotl's formats run here:

- ``weight_dtype: int4`` in groups of ``group_size`` (default 128) along each row, with
  ``activation_dtype: int8`` (per token, asymmetric) or no activation rounding;
- ``weight_dtype: mxfp4`` with ``activation_dtype: mxfp4``, blocks of 32 (MX scaling);
- ``weight_dtype: nvfp4`` with ``activation_dtype: nvfp4``, blocks of 16 with fp8 e4m3 scales under
  a second fp32 scale, as torchao's ``NVFP4Tensor`` rounds them: the weights' of the whole
  tensor, the activations' of each token (so that a token's rounding does not depend on the
  other tokens of the batch, and packed documents stay apart), emulated on any
  device: the rounded values are multiplied in the model's dtype, where torchao's own NVFP4
  training needs a GPU with FP4 matmuls (Blackwell); its backward computes with the rounded
  values too.

``fake_quant_after_n_steps: N`` trains the first N steps without the rounding (int4 only).
The saved model is the plain one: the fake-quantized layers are turned back into linear
layers before saving, for a later post-training quantization to the same format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["QAT_KEYS", "NVFP4FakeQuantizedLinear", "qat_problem", "apply_qat", "convert_qat", "fake_quant_switch"]

QAT_KEYS = ("weight_dtype", "activation_dtype", "group_size", "quantize_embedding", "fake_quant_after_n_steps")


def qat_problem(qat) -> str | None:
    """Why ``qat`` cannot run here (one line), or None."""
    if not isinstance(qat, dict):
        return "must be a mapping like {weight_dtype: int4, activation_dtype: int8, group_size: 32}"
    unknown = sorted(str(k) for k in qat if k not in QAT_KEYS)
    if unknown:
        return f"has keys offloadkit does not read ({', '.join(unknown)}); it reads {', '.join(QAT_KEYS)}"
    weight, activation = qat.get("weight_dtype"), qat.get("activation_dtype")
    group = qat.get("group_size")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        return f"group_size={group!r} must be a positive integer"
    after = qat.get("fake_quant_after_n_steps")
    if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 0):
        return f"fake_quant_after_n_steps={after!r} must be an integer >= 0"
    if qat.get("quantize_embedding"):
        return "quantize_embedding: true (fake-quantized embeddings) is not something offloadkit does"
    if weight == "int4":
        if activation not in (None, "int8"):
            return f"weight_dtype int4 runs with activation_dtype int8 or none here, not {activation!r}"
        return None
    if weight == "mxfp4":
        if activation != "mxfp4":
            return "weight_dtype mxfp4 runs with activation_dtype mxfp4 (torchao has no weight-only MX training)"
        if group not in (None, 32):
            return f"mxfp4 uses blocks of 32, not group_size={group}"
        if after is not None:
            return "fake_quant_after_n_steps cannot switch mxfp4 fake quantization (it is always on)"
        return None
    if weight == "nvfp4":
        if activation != "nvfp4":
            return "weight_dtype nvfp4 runs with activation_dtype nvfp4 here"
        if group not in (None, 16):
            return f"nvfp4 uses blocks of 16, not group_size={group}"
        if after is not None:
            return "fake_quant_after_n_steps cannot switch nvfp4 fake quantization (it is always on)"
        return None
    return (
        f"weight_dtype={weight!r}: offloadkit's QAT runs int4 weights (with int8 or no activation rounding), "
        "mxfp4 and nvfp4; int8 or fp8 weights are not supported"
    )


def _config(qat: dict):
    import torch
    from torchao.quantization.qat import QATConfig

    if qat["weight_dtype"] == "mxfp4":
        from torchao.prototype.qat import MXFakeQuantizeConfig

        mx = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, block_size=32)
        return QATConfig(activation_config=mx, weight_config=mx), 32
    from torchao.quantization.qat.fake_quantize_config import Int4WeightFakeQuantizeConfig, IntxFakeQuantizeConfig

    group = qat.get("group_size") or 128
    activation = None
    if qat.get("activation_dtype") == "int8":
        activation = IntxFakeQuantizeConfig(dtype=torch.int8, granularity="per_token", is_symmetric=False)
    weight = Int4WeightFakeQuantizeConfig(group_size=group, activation_dtype=torch.bfloat16)
    return QATConfig(weight_config=weight, activation_config=activation), group


def _nvfp4_round(x, per: str):
    """``x`` rounded to NVFP4 along its last dim: blocks of 16 with fp8 e4m3 scales under an
    fp32 scale of the whole tensor (``per="tensor"``) or of each row (``per="row"``), back in
    ``x``'s dtype."""
    import torch
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    rows = x.reshape(-1, x.shape[-1]).float()
    if per == "tensor":
        amax = rows.abs().max()
        if amax == 0:
            return x.clone()  # all zeros round to zeros (the scale of a zero amax is 0: 0/0 otherwise)
        scale = per_tensor_amax_to_scale(amax)
        rounded = NVFP4Tensor.to_nvfp4(rows.contiguous(), per_tensor_scale=scale).dequantize(torch.float32)
    else:
        # Each row its own second-level scale: the two-level rounding of the row alone.
        amax = rows.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, per_tensor_amax_to_scale(amax), torch.ones_like(amax))
        unit = NVFP4Tensor.to_nvfp4((rows / scale).contiguous(), per_tensor_scale=None)
        rounded = unit.dequantize(torch.float32) * scale
    return rounded.to(x.dtype).reshape(x.shape)


class _Rounded(torch.autograd.Function):
    """NVFP4 rounding whose gradient passes unchanged (straight through)."""

    @staticmethod
    def forward(ctx, x, per):
        return _nvfp4_round(x, per)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class NVFP4FakeQuantizedLinear(torch.nn.Linear):
    """A linear layer computing with its input and weight rounded to NVFP4 (the weight trains
    in full precision): the weight under a scale of the whole tensor, each token of the input
    under its own, so that a token's rounding does not depend on the other tokens of the batch
    (packed documents stay apart) and small activations keep their precision."""

    def forward(self, x):
        return F.linear(_Rounded.apply(x, "row"), _Rounded.apply(self.weight, "tensor"), self.bias)


def apply_qat(model, qat: dict) -> None:
    """Swap every linear layer of ``model`` for its fake-quantized form, in place.

    Raises:
        ValueError: a layer whose input width is not a multiple of the group size (one line).
    """
    import torch

    group = 16 if qat["weight_dtype"] == "nvfp4" else None
    config = None
    if group is None:
        config, group = _config(qat)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.in_features % group:
            raise ValueError(
                f"{name} takes {module.in_features} inputs, not a multiple of the group size {group}: its weights "
                "cannot be quantized in such groups"
            )
    if config is None:
        # Imported here, not at the first forward: a missing or older torchao stops the run
        # before it starts (NVFP4Tensor.dequantize came in torchao 0.15).
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

        if NVFP4Tensor.dequantize is torch.Tensor.dequantize:  # only the tensor's own (quantized tensors')
            import torchao

            raise ValueError(
                f"weight_dtype nvfp4 needs torchao 0.15 or later (installed: {torchao.__version__}); "
                "pip install -U 'torchao>=0.15'"
            )
        # The same parameters, the forward of the fake-quantized class; convert_qat swaps it back.
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = NVFP4FakeQuantizedLinear
        return
    from torchao.quantization import quantize_

    quantize_(model, config)


def convert_qat(model) -> None:
    """The fake-quantized layers back into linear layers (same weights), in place."""
    import torch
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    for module in model.modules():
        if type(module) is NVFP4FakeQuantizedLinear:
            module.__class__ = torch.nn.Linear  # type: ignore[assignment]  # the same parameters, plain again
    quantize_(model, QATConfig(step="convert"))


def fake_quant_switch(after: int):
    """A Trainer callback: the first ``after`` steps train without the fake quantization."""
    from transformers import TrainerCallback

    def switch(model, on: bool) -> None:
        for module in model.modules():
            for name in ("weight_fake_quantizer", "activation_fake_quantizer"):
                quantizer = getattr(module, name, None)
                if quantizer is not None and hasattr(quantizer, "enabled"):
                    quantizer.enabled = on

    class FakeQuantAfter(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0 and after > 0:
                switch(model, False)
            elif state.global_step == after:
                switch(model, True)

    return FakeQuantAfter()
