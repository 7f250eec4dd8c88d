"""Chunked loss and tiled MLP on real Hugging Face models (random init, tiny configs):
``model(input_ids, labels=labels).loss`` and every gradient against the unchanged model,
with PEFT LoRA, Hugging Face gradient checkpointing, the config route and the Trainer.

Tolerance: fp32, 1e-5 relative to the largest reference value of each tensor.
"""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from offloadkit import apply_chunked_loss, apply_tiled_mlp  # noqa: E402
from offloadkit.compose import prepare  # noqa: E402
from offloadkit.config import ConfigError, OffloadConfig  # noqa: E402
from offloadkit.testing import (  # noqa: E402
    AllocationTracker,
    SavedTensorTracker,
    assert_bitwise_equal,
    build_llama,
    randomize_lora_b,
    run_step,
)

TOL = 1e-5


def close_all(got, ref, tol=TOL):
    loss_g, grads_g = got
    loss_r, grads_r = ref
    torch.testing.assert_close(loss_g, loss_r, rtol=tol, atol=tol * abs(loss_r.item()))
    assert grads_g.keys() == grads_r.keys() and grads_r
    for name in grads_r:
        scale = grads_r[name].abs().max().item() or 1.0
        torch.testing.assert_close(
            grads_g[name], grads_r[name], rtol=tol, atol=tol * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def batch(vocab=256, b=2, seq=33, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, seq), generator=g)
    labels = ids.clone()
    labels[0, :9] = -100  # a prompt that is not trained on
    return {"input_ids": ids, "labels": labels}


def lora(model):
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    return randomize_lora_b(model)


@pytest.mark.parametrize("use_lora", [False, True])
@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_llama_loss_and_grads_match_and_remove_restores(use_lora, checkpointing):
    model = build_llama("tiny", attn_implementation="sdpa")
    if use_lora:
        model = lora(model)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
        )
        if use_lora and checkpointing == "reentrant":
            model.enable_input_require_grads()
    data = batch()
    ref = run_step(model, data)
    loss_handle = apply_chunked_loss(model, num_chunks=3)
    mlp_handle = apply_tiled_mlp(model, num_shards=3)
    got = run_step(model, data)
    close_all(got, ref)
    if use_lora:
        assert all("lora_" in n for n in got[1]), "only adapters train"
    assert loss_handle.calls == 1
    mlp_handle.remove()
    loss_handle.remove()
    again = run_step(model, data)
    assert_bitwise_equal(again[0], ref[0], "loss after remove()")
    assert_bitwise_equal(again[1], ref[1], "grads after remove()")
    assert all(k not in m.__dict__ for m in model.modules() for k in ("forward", "_loss_function"))


def test_logits_empty_with_labels_and_unchanged_without():
    model = build_llama("tiny")
    data = batch()
    with torch.no_grad():
        plain = model(input_ids=data["input_ids"]).logits
    handle = apply_chunked_loss(model)
    with torch.no_grad():
        out = model(**data)
        unchanged = model(input_ids=data["input_ids"]).logits
        positional = model(data["input_ids"], None, None, None, None, data["labels"])
    assert out.logits.shape == (2, 33, 0)
    assert_bitwise_equal(unchanged, plain, "logits without labels")
    assert_bitwise_equal(positional.loss, out.loss, "labels passed positionally")
    assert handle.calls == 2
    handle.remove()


def test_tied_head_full_finetune():
    model = build_llama("tiny", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    data = batch()
    ref = run_step(model, data)
    handle = apply_chunked_loss(model, num_chunks=4)
    close_all(run_step(model, data), ref)
    handle.remove()


def test_num_items_in_batch_and_gradient_accumulation():
    model = lora(build_llama("tiny"))
    micro = [batch(seed=1), batch(seed=2)]
    items = sum(int((F.pad(m["labels"], (0, 1), value=-100)[..., 1:] != -100).sum()) for m in micro)

    def accumulate():
        model.zero_grad(set_to_none=True)
        losses = []
        for m in micro:
            loss = model(**m, num_items_in_batch=torch.tensor(items)).loss
            loss.backward()
            losses.append(loss.detach())
        return sum(losses), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = accumulate()
    handle = apply_chunked_loss(model, num_chunks=2)
    close_all(accumulate(), ref)
    handle.remove()


_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite", "hyperclovax"])
def test_models_that_transform_logits(kind):
    common = _COMMON
    if kind == "hyperclovax" and not hasattr(transformers, "HyperCLOVAXForCausalLM"):
        pytest.skip("this transformers has no HyperCLOVA X")
    cls, config = {
        "gemma2": lambda: (
            transformers.Gemma2ForCausalLM,
            transformers.Gemma2Config(head_dim=16, final_logit_softcapping=5.0, **common),
        ),
        "cohere": lambda: (transformers.CohereForCausalLM, transformers.CohereConfig(logit_scale=0.25, **common)),
        # Granite divides its logits by logits_scaling, HyperCLOVA X multiplies them by it.
        "granite": lambda: (transformers.GraniteForCausalLM, transformers.GraniteConfig(logits_scaling=4.0, **common)),
        "hyperclovax": lambda: (
            transformers.HyperCLOVAXForCausalLM,
            transformers.HyperCLOVAXConfig(logits_scaling=4.0, **common),
        ),
    }[kind]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config)
    data = batch(vocab=128, seq=19)
    ref = run_step(model, data)
    handle = apply_chunked_loss(model, num_chunks=3)
    assert handle.transform is not None
    close_all(run_step(model, data), ref)
    handle.remove()


def test_logits_scaling_of_unknown_direction_is_refused():
    class Scaled(transformers.GraniteForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):  # its source does not show how it scales
            return super().forward(input_ids=input_ids, labels=labels, **kwargs)

    config = transformers.GraniteConfig(logits_scaling=4.0, **_COMMON)
    config._attn_implementation = "eager"
    model = Scaled(config)
    handle = apply_chunked_loss(model, num_chunks=2)
    assert handle.transform is None and "multiplies or divides" in handle.transform_problem
    with pytest.raises(RuntimeError, match="multiplies or divides the logits"):
        model(**batch(vocab=128, seq=19))
    handle.remove()


def test_eval_mode_gets_real_logits_and_the_same_loss():
    model = build_llama("tiny", attn_implementation="sdpa")
    data = batch()
    model.eval()
    with torch.no_grad():
        ref = model(**data)
    handle = apply_chunked_loss(model, num_chunks=2)
    with torch.no_grad():
        got = model(**data)
    assert got.logits.shape == ref.logits.shape and got.logits.shape[-1] == model.config.vocab_size
    assert torch.equal(got.loss, ref.loss) and handle.calls == 0
    model.train()
    assert model(**data).logits.shape[-1] == 0 and handle.calls == 1
    handle.remove()


def test_unrecognised_logit_change_and_unsupported_heads_are_refused():
    model = build_llama("tiny")
    handle = apply_chunked_loss(model)
    hook = model.lm_head.register_forward_hook(lambda m, a, out: out * 2)
    with pytest.raises(RuntimeError, match="does not recognise"):
        model(**batch())
    hook.remove()
    handle.remove()
    lora_head = peft.get_peft_model(build_llama("tiny"), peft.LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ValueError, match="plain nn.Linear head"):
        apply_chunked_loss(lora_head)
    saved_head = peft.get_peft_model(
        build_llama("tiny"), peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    )
    randomize_lora_b(saved_head)
    ref = run_step(saved_head, batch())
    handle = apply_chunked_loss(saved_head, num_chunks=2)
    got = run_step(saved_head, batch())
    assert any("modules_to_save" in n and "lm_head" in n for n in got[1])
    close_all(got, ref)
    with pytest.raises(ValueError, match="already computes"):
        apply_chunked_loss(saved_head)
    handle.remove()


def test_model_never_allocates_full_logits():
    vocab, b, seq = 4096, 2, 256
    model = build_llama("tiny", vocab_size=vocab, attn_implementation="sdpa")
    data = batch(vocab=vocab, b=b, seq=seq)
    full = b * seq * vocab
    with AllocationTracker() as control:
        run_step(model, data)
    assert control.shapes_over(full)
    handle = apply_chunked_loss(model, num_chunks=8)
    with AllocationTracker() as alloc, SavedTensorTracker() as saved:
        run_step(model, data)
    assert not alloc.shapes_over(full // 4), alloc.shapes_over(full // 4)
    assert saved.max_elements < full // 4
    handle.remove()


def test_tiling_the_norms_bounds_their_fp32_upcasts():
    seq, shards = 384, 4
    model = build_llama("tiny", dtype=torch.bfloat16, attn_implementation="sdpa")
    hidden = model.config.hidden_size
    data = batch(b=1, seq=seq)
    ref = run_step(model, data)
    loss_handle = apply_chunked_loss(model, num_chunks=8)  # keeps the loss's fp32 logits out of the picture

    def fp32_full_length(tracker):
        return [r[:2] for r in tracker.records if r[3] == torch.float32 and seq in r[1] and r[1][-1] == hidden]

    with AllocationTracker() as control:
        run_step(model, data)
    assert fp32_full_length(control), "RMSNorm upcasts [B, S, H] to fp32"
    handle = apply_tiled_mlp(
        model, num_shards=shards, predicate=lambda n, m: n.endswith(("mlp", "layernorm")) or n == "model.norm"
    )
    assert len(handle.modules) == 7
    with AllocationTracker() as alloc:
        got = run_step(model, data)
    assert not fp32_full_length(alloc), fp32_full_length(alloc)
    for name in ref[1]:
        err = (got[1][name].float() - ref[1][name].float()).abs().max() / ref[1][name].float().abs().max()
        assert err < 2e-2, f"{name}: {err:.2e}"
    handle.remove()
    loss_handle.remove()


@pytest.mark.parametrize("extra", [{}, {"attention_mask": "ones"}, {"position_ids": "arange"}])
def test_sdpa_single_sequence_builds_no_seq_by_seq_mask(monkeypatch, extra):
    """One sequence per row, no padding: SDPA gets attn_mask=None and is_causal=True, and no
    op allocates anything of seq x seq elements."""
    seq = 512
    model = build_llama("tiny", attn_implementation="sdpa")
    ids = torch.randint(0, 256, (1, seq))
    kwargs = {}
    if "attention_mask" in extra:
        kwargs["attention_mask"] = torch.ones(1, seq, dtype=torch.long)
    if "position_ids" in extra:
        kwargs["position_ids"] = torch.arange(seq)[None]
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kw):
        seen.append((kw.get("attn_mask"), kw.get("is_causal")))
        return sdpa(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with AllocationTracker() as alloc:
        model(input_ids=ids, labels=ids, use_cache=False, **kwargs).loss.backward()
    assert len(seen) == model.config.num_hidden_layers
    assert all(mask is None and causal is True for mask, causal in seen)
    assert not alloc.shapes_over(seq * seq)
    eager = build_llama("tiny", attn_implementation="eager")
    with AllocationTracker() as control:
        eager(input_ids=ids, use_cache=False)
    assert control.shapes_over(seq * seq), "the observable sees an [S, S] mask when one is built"


def test_config_route_composes_with_checkpointing_and_disk_offloading(tmp_path):
    data = batch()
    model = lora(build_llama("tiny", attn_implementation="sdpa"))
    ref = run_step(model, data)
    keys = {
        "chunked_cross_entropy": True,
        "chunked_cross_entropy_num_chunks": 3,
        "tiled_mlp": True,
        "tiled_mlp_num_shards": 2,
    }
    runtime = prepare(model, keys)
    assert runtime.chunked_loss is not None and len(runtime.tiled_mlp.modules) == 2
    alone = run_step(model, data, ctx=runtime.context())
    close_all(alone, ref)
    runtime.close()
    assert all(k not in m.__dict__ for m in model.modules() for k in ("forward", "_loss_function"))
    assert_bitwise_equal(run_step(model, data)[1], ref[1], "after close()")
    runtime = prepare(
        model, {**keys, "gradient_checkpointing": True, "activation_offloading": "disk", "disk_dir": str(tmp_path)}
    )
    composed = run_step(model, data, ctx=runtime.context())
    assert runtime.manager.collect_stats().offloaded_tensors > 0
    runtime.close()
    assert_bitwise_equal(composed[0], alone[0], "loss with checkpointing and offloading")
    assert_bitwise_equal(composed[1], alone[1], "grads with checkpointing and offloading")


def test_config_keys_validated_and_warned():
    cfg = OffloadConfig.from_dict({"chunked_cross_entropy": True, "tiled_mlp": True, "tiled_mlp_num_shards": "auto"})
    assert cfg.tiled_mlp_num_shards is None and cfg.chunked_cross_entropy_num_chunks is None
    for data, message in [
        ({"chunked_cross_entropy": "yes"}, "chunked_cross_entropy='yes' has the wrong type"),
        ({"chunked_cross_entropy_num_chunks": 0}, "chunked_cross_entropy_num_chunks=0 is too small"),
        ({"tiled_mlp_num_shards": 2.5}, "tiled_mlp_num_shards=2.5 has the wrong type"),
        ({"tiled_mlp": 1}, "tiled_mlp=1 has the wrong type"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", "\\(")):
            OffloadConfig.from_dict(data)
    with pytest.warns(UserWarning, match="tiled_mlp_num_shards only applies with tiled_mlp: true"):
        OffloadConfig.from_dict({"tiled_mlp_num_shards": 4})
    with pytest.warns(UserWarning, match="chunked_cross_entropy has no effect"):
        runtime = prepare(
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), {"chunked_cross_entropy": True}
        )
    assert runtime.chunked_loss is None
    runtime.close()


def test_trainer_with_gradient_accumulation(tmp_path):
    """The Trainer passes num_items_in_batch; losses match the unchanged model's."""
    from offloadkit.integrations.trainer import OffloadCallback

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (8, 48))
    rows = [{"input_ids": r, "labels": r.clone()} for r in ids]
    for row in rows[::2]:
        row["labels"][:20] = -100

    def train(callbacks):
        model = build_llama("tiny", attn_implementation="sdpa")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=3,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            seed=0,
            remove_unused_columns=False,
            lr_scheduler_type="constant",
        )
        losses, chunked_calls = [], []

        class Record(transformers.TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    losses.append(logs["loss"])

            def on_step_end(self, args, state, control, **kw):
                for cb in callbacks:
                    chunked_calls.append(cb.runtime.chunked_loss.calls)

        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[Record(), *callbacks])
        trainer.train()
        return losses, chunked_calls

    ref, _ = train([])
    got, calls = train([OffloadCallback({"chunked_cross_entropy": True, "tiled_mlp": True, "tiled_mlp_num_shards": 2})])
    assert calls == [2, 4, 6], "every micro-batch's loss went through the chunked path"
    assert len(got) == len(ref) == 3
    assert got == pytest.approx(ref, rel=1e-4)


def test_trainer_evaluation_inside_train_sees_real_logits(tmp_path):
    """compute_metrics inside train() gets full-vocabulary predictions, with the chunked loss on."""
    from offloadkit.integrations.trainer import OffloadCallback

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (6, 24))
    rows = [{"input_ids": r, "labels": r.clone()} for r in ids]
    seen = []

    def metrics(pred):
        seen.append(pred.predictions.shape)
        return {"top1": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}

    def run(callbacks):
        seen.clear()
        model = build_llama("tiny", attn_implementation="sdpa")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            max_steps=2,
            eval_strategy="steps",
            eval_steps=1,
            learning_rate=1e-2,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            seed=0,
            remove_unused_columns=False,
        )
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=rows,
            eval_dataset=rows[:4],
            compute_metrics=metrics,
            callbacks=callbacks,
        )
        trainer.train()
        return [h for h in trainer.state.log_history if "eval_loss" in h], list(seen)

    ref_logs, ref_shapes = run([])
    logs, shapes = run([OffloadCallback({"chunked_cross_entropy": True})])
    assert shapes == ref_shapes and shapes[0][-1] == 256, shapes
    assert [h["eval_top1"] for h in logs] == [h["eval_top1"] for h in ref_logs]
    assert [h["eval_loss"] for h in logs] == pytest.approx([h["eval_loss"] for h in ref_logs], rel=1e-5)


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant"])
def test_tiled_projections_match_and_remove_restores(checkpointing):
    """Norms and attention projections (with LoRA adapters) over shards: fp32 parity."""
    model = lora(build_llama("tiny", attn_implementation="sdpa"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = batch()
    ref = run_step(model, data)
    handle = apply_tiled_mlp(model, num_shards=3, projections=True)
    layers = model.config.num_hidden_layers
    names = [n for n, _ in handle.modules]
    assert len(names) == 7 * layers + 1, names  # mlp, two norms, q/k/v/o; the final norm
    assert names[-1] == "model.norm"
    assert sum(n.endswith("self_attn.q_proj") for n in names) == layers
    got = run_step(model, data)
    close_all(got, ref)
    handle.remove()
    again = run_step(model, data)
    assert_bitwise_equal(again[1], ref[1], "grads after remove()")


def test_tiled_projections_config_route():
    with pytest.raises(ConfigError, match="tiled_projections: true needs tiled_mlp: true"):
        OffloadConfig.from_dict({"tiled_projections": True})
    model = lora(build_llama("tiny", attn_implementation="sdpa"))
    runtime = prepare(
        model, {"tiled_mlp": True, "tiled_mlp_num_shards": 2, "tiled_projections": True, "gradient_checkpointing": True}
    )
    assert len(runtime.tiled_mlp.modules) == 7 * model.config.num_hidden_layers + 1
    ref_model = lora(build_llama("tiny", attn_implementation="sdpa"))
    ref_model.load_state_dict(model.state_dict())
    data = batch()
    with runtime.context():
        got = run_step(model, data)
    close_all(got, run_step(ref_model, data))
    runtime.close()


def _moe(kind, **extra):
    common = dict(_COMMON, output_router_logits=True, router_aux_loss_coef=0.5)
    if kind == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common, **extra)
        cls = transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            **common,
            **extra,
        )
        cls = transformers.Qwen2MoeForCausalLM
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16, **common, **extra
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.GptOssConfig(
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            layer_types=["full_attention"] * 2,
            **common,
            **extra,
        )
        cls = transformers.GptOssForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_moe_tiled_keeps_router_aux_loss_gradient(kind):
    """MoE blocks with the router's auxiliary loss, batch > 1: the experts run tiled, the
    router whole, and every gradient (the router's too) matches the untiled model."""
    model = _moe(kind)
    data = batch(vocab=128, b=3, seq=17)
    ref = run_step(model, data)
    gates = [n for n in ref[1] if ".gate." in n or ".router." in n]
    assert gates and all(ref[1][n].abs().sum() > 0 for n in gates)
    handle = apply_tiled_mlp(model, num_shards=3)
    names = [n for n, _ in handle.modules]
    assert any(n.endswith(".experts") for n in names), names
    assert (kind == "qwen2_moe") == any(n.endswith("shared_expert") for n in names)
    close_all(run_step(model, data), ref)
    handle.remove()


def test_moe_block_chosen_whole_is_refused():
    model = _moe("mixtral")
    with pytest.raises(ValueError, match="MoE block.*router.*experts"):
        apply_tiled_mlp(model, predicate=lambda name, module: name.endswith("mlp"))


def test_mixtral_router_jitter_writes_its_input_in_place():
    """Mixtral's router jitter scales the MoE block's input in place in training. With one
    shard the noise is drawn over the same elements as untiled: equal gradients."""
    model = _moe("mixtral", router_jitter_noise=0.1)
    data = batch(vocab=128, b=2, seq=17)
    torch.manual_seed(5)
    ref = run_step(model, data)
    handle = apply_tiled_mlp(model, num_shards=1)
    torch.manual_seed(5)
    close_all(run_step(model, data), ref)
    handle.remove()
    handle = apply_tiled_mlp(model, num_shards=4)
    loss, grads = run_step(model, data)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    handle.remove()


def test_gpt2_conv1d_mlp_with_batch():
    config = transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    data = batch(vocab=128, b=3, seq=17)
    ref = run_step(model, data)
    handle = apply_tiled_mlp(model, num_shards=4)
    close_all(run_step(model, data), ref)
    handle.remove()
