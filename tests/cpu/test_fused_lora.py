"""The fused LoRA path (``fused_lora``): its gradients are exact in float64, its outputs and
gradients agree with PEFT's within bf16 tolerance on a bf16 model, it keeps PEFT's forward
wherever it would compute something else, offloading stays bitwise with it on, and it saves
what its footprint says."""

import copy

import pytest
import torch

from offloadkit.lora import apply_fused_lora, lora_linear
from offloadkit.lora import fused as fused_module
from offloadkit.lora.options import LoraOptions
from offloadkit.planning.plan import option
from offloadkit.testing import build_llama, randomize_lora_b, run_step

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")


@pytest.mark.parametrize("separate", [False, True])
def test_its_gradients_are_exact_in_float64(separate):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    xl = (x * 0.5).detach().requires_grad_() if separate else None
    w = torch.randn(4, 6, dtype=torch.float64, generator=g)
    b = torch.randn(4, dtype=torch.float64, generator=g)
    a = torch.randn(3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    bb = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    inputs = (x, w, b, a, bb, 0.7) if not separate else (x, w, b, a, bb, 0.7, xl)
    assert torch.autograd.gradcheck(lora_linear, inputs)
    expected = x @ w.t() + b + 0.7 * ((x if xl is None else xl) @ a.t()) @ bb.t()
    torch.testing.assert_close(lora_linear(*inputs), expected)


def _lora_model(dtype=torch.bfloat16, layers=2, **lora):
    model = build_llama("tiny", dtype=dtype, attn_implementation="sdpa", num_hidden_layers=layers)
    model.config.use_cache = False
    config = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0) | lora
    model = peft.get_peft_model(model, peft.LoraConfig(**config))
    randomize_lora_b(model)
    model.train()
    return model


def _step(model, batch):
    return run_step(model, batch)


def _batch(seq=64, batch=2):
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def test_outputs_and_gradients_agree_with_peft_within_bf16_tolerance():
    """Against an fp32 run of the same weights, the fused bf16 path is no further off than
    PEFT's own bf16 path (plus bf16's rounding of one value), and close to it."""
    peft_model = _lora_model()
    reference = copy.deepcopy(peft_model).float()
    fused = copy.deepcopy(peft_model)
    handle = apply_fused_lora(fused)
    assert len(handle.layers) == 2 * 7 and not handle.skipped
    batch = _batch()
    loss_p, grads_p = _step(peft_model, batch)
    loss_f, grads_f = _step(fused, batch)
    loss_r, grads_r = _step(reference, batch)
    assert set(grads_f) == set(grads_p) and all("lora_" in n for n in grads_f)
    assert abs(loss_f - loss_p) <= 1e-2 * abs(loss_p)
    assert all(g.dtype == torch.float32 for g in grads_f.values())  # the adapters' own dtype
    bf16 = 2.0**-8
    for name in grads_p:
        off_fused, off_peft = _rel(grads_f[name], grads_r[name]), _rel(grads_p[name], grads_r[name])
        assert off_fused <= 2 * off_peft + bf16, (name, off_fused, off_peft)
        assert _rel(grads_f[name], grads_p[name]) < 4 * bf16, name
    handle.remove()
    loss_again, grads_again = _step(fused, batch)
    assert torch.equal(loss_again, loss_p)  # PEFT's forward back
    assert all(torch.equal(grads_again[n], grads_p[n]) for n in grads_p)


def test_dropout_goes_to_the_adapter_only():
    model = _lora_model(lora_dropout=0.5)
    apply_fused_lora(model)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 8, layer.in_features, dtype=torch.bfloat16)
    torch.manual_seed(3)
    out = layer(x)
    torch.manual_seed(3)
    mask_input = layer.lora_dropout["default"](x)
    base = layer.get_base_layer()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = lora_linear(x, base.weight, base.bias, a, b, layer.scaling["default"], x_lora=mask_input)
    assert torch.equal(out, expected)
    model.eval()
    no_dropout = lora_linear(x, base.weight, base.bias, a, b, layer.scaling["default"])
    assert torch.equal(layer(x), no_dropout)


def _outputs(model, batch):
    with torch.no_grad():
        return model(**batch).logits


@pytest.mark.parametrize("case", ["disabled", "merged", "dora", "fp32", "two adapters", "lora bias"])
def test_where_it_would_compute_something_else_peft_runs(case):
    extra = {"lora_bias": True} if case == "lora bias" else {}
    model = _lora_model(dtype=torch.float32 if case == "fp32" else torch.bfloat16, use_dora=case == "dora", **extra)
    if case == "lora bias":
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n and n.endswith("bias"):
                    p.normal_()  # PEFT starts it at zero
    if case == "two adapters":
        model.add_adapter("second", peft.LoraConfig(r=4, target_modules="all-linear"))
        model.base_model.set_adapter(["default", "second"])
    batch = _batch(seq=16)
    fused = copy.deepcopy(model)
    apply_fused_lora(fused)
    if case == "merged":
        model.merge_adapter()
        fused.merge_adapter()
    if case == "disabled":
        with model.disable_adapter(), fused.disable_adapter():
            assert torch.equal(_outputs(model, batch), _outputs(fused, batch))
        return
    assert torch.equal(_outputs(model, batch), _outputs(fused, batch))


def test_a_model_without_lora_layers_is_refused_and_prepare_says_it_has_no_effect():
    from offloadkit.compose import prepare

    model = build_llama("tiny", num_hidden_layers=1)
    with pytest.raises(ValueError, match="no PEFT LoRA linear layers"):
        apply_fused_lora(model)
    with pytest.warns(UserWarning, match="fused_lora has no effect"):
        runtime = prepare(model, {"fused_lora": True})
    assert runtime.handles.get("fused_lora") is None
    runtime.close()


def test_offloading_stays_bitwise_with_it_on_and_close_detaches_it():
    """Through prepare(): checkpointing with every block input offloaded, against the same
    fused model checkpointed without offloading."""
    from offloadkit.compose import prepare

    model = _lora_model(layers=3)
    batch = _batch()
    plain = prepare(copy.deepcopy(model), {"fused_lora": True, "gradient_checkpointing": True})
    offloaded_model = copy.deepcopy(model)
    runtime = prepare(
        offloaded_model, {"fused_lora": True, "gradient_checkpointing": True, "activation_offloading": True}
    )
    assert runtime.report()["fused_lora"] == {"layers": 3 * 7, "unfused": 0}
    with plain.context():
        expected = _step(plain.model, batch)
    with runtime.context():
        got = _step(offloaded_model, batch)
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(got[1][n], expected[1][n]) for n in expected[1])
    runtime.close()
    plain.close()
    assert not any("forward" in m.__dict__ for m in offloaded_model.modules() if hasattr(m, "lora_A"))


@pytest.mark.parametrize("tiled", [False, True])
def test_a_layer_saves_what_the_footprint_says(tiled):
    """What one decoder layer saves, fused against PEFT's, changes by the fused path's
    footprint (its layer_saved: attention's adapters; untiled, the MLP's too)."""
    from offloadkit import apply_tiled_mlp
    from offloadkit.component import OptionSet
    from offloadkit.lora.component import fused_lora_footprint
    from offloadkit.planning.memory import Workload
    from offloadkit.planning.plan import planned_options
    from offloadkit.planning.shape import resolve_shape
    from offloadkit.testing.allocations import saved_bytes_in_layer

    batch = _batch(seq=256)
    saved = {}
    for fused in (False, True):
        model = _lora_model(layers=3)
        model.enable_input_require_grads()  # as under checkpointing: layer inputs require grad
        if tiled:
            apply_tiled_mlp(model, num_shards=4)
        if fused:
            apply_fused_lora(model)
        saved[fused] = saved_bytes_in_layer(model, batch, 1)
    w = Workload(resolve_shape("tiny"), 256, 2, lora_rank=8)
    f = OptionSet(planned_options(w, fused_lora=True, mlp_shards=4 if tiled else 1))
    change = fused_lora_footprint(w, f).layer_saved
    assert change < 0
    measured = saved[True] - saved[False]
    assert abs(measured - change) <= 0.03 * saved[False], (measured, change, saved)


def test_the_planner_counts_it_when_the_run_asks_for_it(capsys):
    from offloadkit.cli.main import main
    from offloadkit.planning import Budgets, plan

    budgets = Budgets(79 << 30, 110 << 30, 100 << 30)
    peft_plan = plan("llama-3-8b", 65536, budgets=budgets)
    fused_plan = plan("llama-3-8b", 65536, budgets=budgets, fused_lora=True)
    assert option(fused_plan.options, LoraOptions).fused is True
    assert option(peft_plan.options, LoraOptions).fused is not True
    assert fused_plan.to_config()["fused_lora"] is True and "fused_lora" not in peft_plan.to_config()
    assert fused_plan.memory.gpu_peak < peft_plan.memory.gpu_peak
    full = plan("llama-3-8b", 65536, lora_rank=0, budgets=budgets, fused_lora=True)
    assert option(full.options, LoraOptions).fused is not True
    argv = ["plan", "--shape", "llama-3-8b", "--seq-len", "262144", "--gpu-gib", "79", "--host-gib", "110"]
    assert main([*argv, "--disk-gib", "100", "--fused-lora"]) == 0
    assert "fused_lora: true" in capsys.readouterr().out
    # Through prepare(): offload_plan auto plans the fused path the config asks for.
    from offloadkit.compose import prepare

    model = _lora_model(layers=2)
    runtime = prepare(model, {"offload_plan": "auto", "seq_len": 256, "fused_lora": True})
    assert option(runtime.plan.options, LoraOptions).fused is True and runtime.config.fused_lora
    assert runtime.report()["fused_lora"]["layers"] == 2 * 7
    runtime.close()


@pytest.mark.parametrize(
    "case, fused",
    [("unset", True), ("false", False), ("fp32 weights", False), ("dora", False), ("full fine-tune", False)],
)
def test_offload_plan_auto_turns_it_on_where_every_layer_fuses(case, fused):
    """Left unset, ``offload_plan: auto`` runs a 16-bit LoRA model's layers fused (faster,
    less saved): not where the config says false, nor where some layer would keep PEFT's
    forward (32-bit weights, DoRA), nor without LoRA."""
    from offloadkit.compose import prepare

    if case == "full fine-tune":
        model = build_llama("tiny", dtype=torch.bfloat16, attn_implementation="sdpa")
    else:
        kwargs = {"use_dora": True} if case == "dora" else {}
        model = _lora_model(dtype=torch.float32 if case == "fp32 weights" else torch.bfloat16, **kwargs)
    config = {"offload_plan": "auto", "seq_len": 256} | ({"fused_lora": False} if case == "false" else {})
    runtime = prepare(model, config)
    assert (option(runtime.plan.options, LoraOptions).fused is True) is fused
    assert ("fused_lora" in runtime.report()) is fused
    assert (runtime.config.fused_lora is True) is fused
    runtime.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_under_autocast_it_agrees_with_peft(dtype):
    """As the Trainer runs a model with ``bf16=True`` (autocast on): a bf16 model, and an fp32
    one, whose fp32 inputs the fused path computes in bf16 as autocast does PEFT's."""
    peft_model = _lora_model(dtype=dtype)
    fused = copy.deepcopy(peft_model)
    apply_fused_lora(fused)
    batch = _batch(seq=32)
    calls = []
    real = fused_module.lora_linear
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_p, grads_p = _step(peft_model, batch)
        fused_module.lora_linear = lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k)
        try:
            loss_f, grads_f = _step(fused, batch)
        finally:
            fused_module.lora_linear = real
    assert calls and set(calls) == {torch.bfloat16}
    assert all(grads_f[n].dtype == grads_p[n].dtype for n in grads_p)
    assert abs(loss_f - loss_p) <= 1e-2 * abs(loss_p)
    for name in grads_p:
        assert _rel(grads_f[name], grads_p[name]) < 2.0**-6, name


def test_a_list_fuses_the_layers_of_those_names_only():
    from offloadkit.compose import prepare

    model = _lora_model(layers=2)
    handle = apply_fused_lora(model, ["q_proj", "k_proj", "v_proj"])
    assert len(handle.layers) == 2 * 3
    assert all(
        n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")
        for n, m in model.named_modules()
        if "forward" in m.__dict__
    )
    handle.remove()
    with pytest.raises(ValueError, match="no PEFT LoRA linear layers named nothing_here"):
        apply_fused_lora(model, ["nothing_here"])
    runtime = prepare(model, {"fused_lora": ["gate_proj", "up_proj", "down_proj"]})
    assert runtime.report()["fused_lora"]["layers"] == 2 * 3
    runtime.close()
    for bad in ([], [""], "q_proj", 1):
        with pytest.raises(ValueError, match="fused_lora"):
            LoraOptions.from_config(type("C", (), {"fused_lora": bad})())


@pytest.mark.parametrize(
    "family",
    ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral", "gpt_oss", "qwen2_vl"],
)
def test_every_family_agrees_with_peft_within_bf16_tolerance(family):
    """The compatibility matrix's families, LoRA on every linear layer (Phi-3's fused qkv and
    gate_up included; experts' fused parameters are PEFT's ParamWrapper, which keeps its path):
    the fused run against PEFT's, both bf16, judged against an fp32 run."""
    from offloadkit.testing.families import build_family, family_batch

    base = build_family(family, dtype=torch.bfloat16)
    peft_model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    randomize_lora_b(peft_model)
    reference = copy.deepcopy(peft_model).float()
    fused = copy.deepcopy(peft_model)
    handle = apply_fused_lora(fused)
    assert handle.layers
    batch = family_batch(family, peft_model.get_base_model(), 32, batch=2)
    if "pixel_values" in batch:
        batch_bf16 = dict(batch, pixel_values=batch["pixel_values"].to(torch.bfloat16))
    else:
        batch_bf16 = batch
    loss_p, grads_p = _step(peft_model, batch_bf16)
    loss_f, grads_f = _step(fused, batch_bf16)
    _, grads_r = _step(reference, batch)
    assert abs(loss_f - loss_p) <= 2e-2 * abs(loss_p), (loss_f, loss_p)
    # Top-k routing turns a rounding difference into another expert for a token near a tie
    # (seen: 1 of 64 tokens in Mixtral's second layer, against both PEFT's bf16 run and the
    # fp32 one), which moves every gradient upstream of it by more than rounding: there the
    # mixture-of-experts families are held to 30% of the fp32 run's gradient (a wrong scale,
    # transpose or dropped term is off by 100%), the dense ones to PEFT's own rounding.
    moe = family in ("qwen3_moe", "mixtral", "gpt_oss")
    bf16 = 2.0**-8
    for name in grads_p:
        off_fused, off_peft = _rel(grads_f[name], grads_r[name]), _rel(grads_p[name], grads_r[name])
        bound = max(0.3, 2 * off_peft + 2 * bf16) if moe else 2 * off_peft + 2 * bf16
        assert off_fused <= bound, (name, off_fused, off_peft)


def test_inside_the_tiled_projections_the_fused_path_runs_shard_by_shard(monkeypatch):
    """prepare() fuses the LoRA layers before the tiled projections wrap them: the tiles call
    the fused forward; a fused path applied after another wrapper is refused, not hidden."""
    from offloadkit import apply_tiled_mlp
    from offloadkit.compose import prepare
    from offloadkit.lora import fused as fused_module

    calls = []
    real = fused_module.lora_linear
    monkeypatch.setattr(fused_module, "lora_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _lora_model(layers=2)
    reference = copy.deepcopy(model)
    batch = _batch(seq=128)
    config = {"fused_lora": True, "tiled_mlp": True, "tiled_mlp_num_shards": 4, "tiled_projections": True}
    runtime = prepare(model, config)
    loss, grads = _step(model, batch)
    runtime.close()
    assert len(calls) >= 2 * 7 * 4  # every adapted projection, once a shard (recomputes add more)
    loss_ref, grads_ref = _step(reference, batch)
    assert abs(loss - loss_ref) <= 1e-2 * abs(loss_ref)
    assert all(_rel(grads[n], grads_ref[n]) < 2.0**-5 for n in grads_ref)
    handle = apply_tiled_mlp(model, num_shards=2, projections=True)
    with pytest.raises(ValueError, match="already wrapped; apply the fused LoRA path first"):
        apply_fused_lora(model)
    handle.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_the_trainer_mixin_trains_with_it_evaluates_midway_and_saves_the_adapters(tmp_path):
    """As a user runs it: a bf16 LoRA model through the Trainer with the mixin and
    ``fused_lora: true``, gradient accumulation, an evaluation between steps, the adapters
    saved; the run's losses within bf16 tolerance of the same run without it."""
    transformers = pytest.importorskip("transformers")
    from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    class OffloadTrainer(ActivationOffloadingMixin, transformers.Trainer):
        pass

    def run(fused: bool, out: str):
        model = build_llama("tiny", vocab_size=259, dtype=torch.bfloat16, attn_implementation="sdpa")
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        data = TokenBlocks(byte_tokenizer(), load_texts(), 64)
        args = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=3,
            eval_strategy="steps",
            eval_steps=2,
            per_device_eval_batch_size=2,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            bf16=True,
            remove_unused_columns=False,
            logging_steps=1,
            learning_rate=1e-3,
        )
        trainer = OffloadTrainer(
            model=model,
            args=args,
            train_dataset=data,
            eval_dataset=torch.utils.data.Subset(data, range(4)),
            offload_config={"gradient_checkpointing": True, "activation_offloading": True, "fused_lora": fused},
        )
        trainer.train()
        logs = trainer.state.log_history
        model.save_pretrained(out + "/adapter")
        return trainer, [e["loss"] for e in logs if "loss" in e], [e["eval_loss"] for e in logs if "eval_loss" in e]

    trainer, losses, evals = run(True, str(tmp_path / "fused"))
    _, losses_peft, evals_peft = run(False, str(tmp_path / "peft"))
    assert trainer.offload_report["fused_lora"]["layers"] == 2 * 7
    assert len(losses) == 3 and evals and len(evals) == len(evals_peft)
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(losses + evals, losses_peft + evals_peft))
    assert (tmp_path / "fused" / "adapter" / "adapter_model.safetensors").exists()
    model = trainer.model
    assert not any("forward" in m.__dict__ for m in model.modules() if hasattr(m, "lora_A")), "detached after train()"
