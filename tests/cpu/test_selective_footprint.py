"""Selective checkpointing in the planner's terms: every layer holds the outputs of the ops it
saves (``selective_saved_bytes``, held to the bytes those ops return in a layer's forward, for
a full fine-tune, PEFT's LoRA and fused LoRA), and its recompute skips them (no matmul or
attention forward counted again); the attention outputs it saves replace kept ones."""

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.checkpointing.footprint import keeps_attention, selective_saved_bytes
from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.checkpointing.selective import resolve_ops
from offloadkit.component import OptionSet
from offloadkit.engine.options import ActivationOptions
from offloadkit.longctx.options import LongContextOptions
from offloadkit.lora.options import LoraOptions
from offloadkit.planning import Workload, estimate_memory, resolve_shape
from offloadkit.planning.timing import step_flops
from offloadkit.runtime.dispatch import TorchDispatchMode, tree_leaves
from offloadkit.testing import build_llama, make_batch

pytest.importorskip("transformers")

SEQ, BATCH, RANK = 128, 2, 8


class _Returned(TorchDispatchMode):
    """Bytes the chosen ops return while it is on."""

    def __init__(self, ops):
        super().__init__()
        self.ops, self.bytes = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves(out) if torch.is_tensor(t))
        return out


def _measured(lora: str, save: tuple) -> int:
    """What one checkpointed layer's forward returns from the saved ops (the first forward,
    which selective checkpointing caches for the recompute)."""
    torch.manual_seed(0)
    model = build_llama("tiny", dtype=torch.bfloat16, attn_implementation="sdpa", num_hidden_layers=2)
    model.config.use_cache = False
    if lora != "full":
        from offloadkit.integrations.peft_utils import apply_lora

        model = apply_lora(model, rank=RANK)
        if lora == "fused":
            from offloadkit.lora import apply_fused_lora

            apply_fused_lora(model)
    model.train()
    handle = apply_activation_checkpointing(model, selective=save)
    layers = model.get_base_model().model.layers if lora != "full" else model.model.layers
    mode = _Returned(resolve_ops(save))

    def enter(*_):
        mode.__enter__()  # returning it would replace the layer's arguments

    def leave(*_):
        mode.__exit__(None, None, None)

    pre, post = layers[1].register_forward_pre_hook(enter), layers[1].register_forward_hook(leave)
    model(**make_batch(256, BATCH, SEQ, seed=1)).loss.backward()
    pre.remove(), post.remove(), handle.remove()
    return mode.bytes


def _options(save, fused=False, **checkpoint):
    return OptionSet((CheckpointOptions(enabled=True, selective=list(save), **checkpoint), LoraOptions(fused=fused)))


@pytest.mark.parametrize(
    "lora, save",
    [(lora, save) for lora in ("full", "peft") for save in (("mm", "attention"), ("mm",), ("attention",))]
    + [("fused", ("attention",))],
)
def test_a_layer_holds_what_the_saved_ops_return(lora, save):
    w = Workload(resolve_shape("tiny"), SEQ, BATCH, lora_rank=0 if lora == "full" else RANK)
    predicted = selective_saved_bytes(w, _options(save, fused=lora == "fused"))
    assert predicted == _measured(lora, save)


def test_saving_matmul_outputs_with_the_fused_lora_path_is_refused_before_the_first_step():
    """The fused path sums each adapter into its base projection's output in place; selective
    checkpointing's saved copy refuses that in backward (torch: "Tensor cached during selective
    activation checkpoint has been mutated"). Refused in the config, and ``offload_plan: auto``
    leaves the LoRA layers on PEFT's path then."""
    from offloadkit.compose import _plans_fused_lora
    from offloadkit.config import ConfigError, OffloadConfig
    from offloadkit.integrations.peft_utils import apply_lora

    with pytest.raises(RuntimeError, match="mutated"):
        _measured("fused", ("mm",))
    for fused in (True, ["q_proj"]):
        with pytest.raises(ConfigError, match="set fused_lora: false, or save only"):
            OffloadConfig.from_dict(
                {"selective_checkpointing": ["mm"], "fused_lora": fused, "gradient_checkpointing": True}
            )
    model = apply_lora(build_llama("tiny", dtype=torch.bfloat16, num_hidden_layers=1), rank=RANK)
    auto = {"offload_plan": "auto", "gradient_checkpointing": True}
    assert _plans_fused_lora(model, OffloadConfig.from_dict(auto))
    assert not _plans_fused_lora(model, OffloadConfig.from_dict({**auto, "selective_checkpointing": ["mm"]}))


def test_the_step_holds_every_layers_saves_and_its_recompute_skips_their_ops():
    w = Workload(resolve_shape("llama-3.2-1b"), 16384, lora_rank=0)
    plain = OptionSet((CheckpointOptions(enabled=True),))
    both = _options(("mm", "attention"))
    saves = estimate_memory(w, both).gpu_parts["selective saves"]
    assert saves == w.shape.layers * selective_saved_bytes(w, both) > 0
    assert "selective saves" not in estimate_memory(w, plain).gpu_parts
    linear_fwd, linear_bwd, attn_fwd, attn_bwd = step_flops(w, plain)
    _, linear_bwd_sel, _, attn_bwd_sel = step_flops(w, both)
    recompute = sum(a * b for a, b in w.shape.linears) * w.shape.layers * 2 * w.tokens
    assert linear_bwd - linear_bwd_sel == recompute  # the layers' matmuls not run again
    assert attn_bwd - attn_bwd_sel == attn_fwd  # nor their attention
    assert step_flops(w, _options(("attention",)))[1] == linear_bwd


def test_saved_attention_outputs_are_not_also_kept():
    """The runtime keeps no attention outputs for a selective recompute (it takes its saved
    ones): the planner counts none in host RAM."""
    w = Workload(resolve_shape("tiny"), SEQ)
    offloaded = ActivationOptions(mode=True)
    kept = OptionSet((CheckpointOptions(enabled=True, keep_attention=True), offloaded))
    both = OptionSet((CheckpointOptions(enabled=True, keep_attention=True, selective=["attention"]), offloaded))
    assert keeps_attention(w, kept) == w.shape.layers and keeps_attention(w, both) == 0


def test_the_plan_keeps_the_runs_selective_checkpointing_and_counts_it():
    """A run that sets selective_checkpointing keeps it under offload_plan: auto, and the plan
    counts every layer's saves (it did not: the plan of such a run predicted a peak without them)."""
    from offloadkit.planning import Budgets, plan

    budgets = Budgets(79 << 30, 100 << 30, 60 << 30)
    given = (CheckpointOptions(enabled=True, selective=["attention"]),)
    chosen = plan("llama-3-8b", 16384, budgets=budgets, options=given)
    assert chosen.to_config()["selective_checkpointing"] == ["attention"]
    w = chosen.workload
    assert chosen.memory.gpu_parts["selective saves"] == w.shape.layers * selective_saved_bytes(
        w, _options(("attention",))
    )
    assert "selective saves" not in plan("llama-3-8b", 16384, budgets=budgets).memory.gpu_parts


def test_keeping_attention_outputs_beside_selective_checkpointing_warns_it_has_no_effect():
    from offloadkit.config import OffloadConfig

    keys = {"gradient_checkpointing": True, "activation_offloading": True, "keep_attention_outputs": True}
    with pytest.warns(UserWarning, match="keep_attention_outputs has no effect with selective_checkpointing"):
        OffloadConfig.from_dict({**keys, "selective_checkpointing": ["mm"]})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OffloadConfig.from_dict(keys)


class _MatmulFlops(TorchDispatchMode):
    """2 m n k of every matmul while it is on."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = (args[0], args[1]) if func is torch.ops.aten.mm.default else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def _backward_matmul_flops(shards: int) -> int:
    from offloadkit import apply_tiled_mlp

    torch.manual_seed(0)
    model = build_llama("tiny", attn_implementation="sdpa", num_hidden_layers=2)
    model.config.use_cache = False
    if shards > 1:
        apply_tiled_mlp(model, num_shards=shards)
    apply_activation_checkpointing(model, selective=("mm",))
    loss = model(**make_batch(256, 1, 256, seed=1)).loss
    counter = _MatmulFlops()
    with counter:
        loss.backward()
    return counter.flops


def test_a_tiled_mlp_runs_its_forward_again_in_backward_when_matmul_outputs_are_saved():
    """Saved matmul outputs spare the layer's recompute, not a tiled MLP's forward in its own
    backward (outside the checkpoint): the planner counts it, as measured."""
    w = Workload(resolve_shape("tiny"), 256, 1, lora_rank=0)
    tiled = OptionSet(
        (
            CheckpointOptions(enabled=True, selective=["mm"]),
            LongContextOptions(tiled_mlp=True, mlp_shards=4),
        )
    )
    untiled = _options(("mm",))
    predicted = step_flops(w, tiled)[1] - step_flops(w, untiled)[1]
    measured = _backward_matmul_flops(4) - _backward_matmul_flops(1)
    assert predicted == measured > 0


def test_the_probe_runs_under_no_grad_and_inference_mode():
    from offloadkit.kernels import attention as attention_module

    attention_module._PROBED.clear()
    for context in (torch.no_grad(), torch.inference_mode()):
        with context:
            assert attention_module.probe_error("flash", torch.device("cpu")) is None
        attention_module._PROBED.clear()
