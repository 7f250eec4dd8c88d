"""``optimizer_offloading: true`` through the Trainer mixin: the Trainer's AdamW replaced by
BackwardAdamW, with losses and weights bitwise those of the Trainer's own AdamW (clipping on
and off, gradient accumulation, a linear schedule with warm-up), and a checkpoint resumed
exactly."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offloadkit.config import ConfigError  # noqa: E402
from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts  # noqa: E402
from offloadkit.integrations.trainer import ActivationOffloadingMixin  # noqa: E402
from offloadkit.optim import BackwardAdamW  # noqa: E402
from offloadkit.testing import assert_bitwise_equal, build_llama  # noqa: E402


class OffloadTrainer(ActivationOffloadingMixin, transformers.Trainer):
    pass


OFFLOAD = {"optimizer_offloading": True, "activation_offloading": False}


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=4,
        learning_rate=3e-3,
        weight_decay=0.01,
        warmup_steps=2,
        lr_scheduler_type="linear",
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _train(cls, tmp_path, resume=None, offload=OFFLOAD, dtype=torch.float32, optimizers_factory=None, **kw):
    torch.manual_seed(0)
    model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa", dtype=dtype)
    extra = {"offload_config": offload} if cls is OffloadTrainer else {}
    if optimizers_factory is not None:
        extra["optimizers"] = optimizers_factory(model)
    trainer = cls(
        model=model, args=_args(tmp_path, **kw), train_dataset=TokenBlocks(byte_tokenizer(), load_texts(), 32), **extra
    )
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "max_grad_norm, accumulation, optim",
    [(1.0, 1, "adamw_torch"), (0.0, 1, "adamw_torch"), (1.0, 2, "adamw_torch"), (0.0, 2, "adamw_torch_fused")],
)
def test_trainer_losses_and_weights_bitwise_with_the_trainers_adamw(tmp_path, max_grad_norm, accumulation, optim):
    kw = {"max_grad_norm": max_grad_norm, "gradient_accumulation_steps": accumulation, "optim": optim}
    _, ref_losses, ref_weights = _train(transformers.Trainer, tmp_path / "plain", **kw)
    trainer, losses, weights = _train(OffloadTrainer, tmp_path / "ours", **kw)
    assert isinstance(trainer.optimizer.optimizer, BackwardAdamW)
    assert trainer.optimizer.optimizer.updates_in_backward == (max_grad_norm == 0.0)
    assert any("replaced by BackwardAdamW" in n for n in trainer.offload_report["notes"])
    assert "optimizer state" in trainer.offload_report["prefetch"]["lanes"]  # the run's one scheduler
    assert losses == ref_losses and len(losses) == 4
    assert_bitwise_equal(ref_weights, weights, "weights after training")


def test_resuming_a_checkpoint_continues_exactly(tmp_path):
    _, full_losses, full_weights = _train(OffloadTrainer, tmp_path / "full", max_grad_norm=0.0)
    _train(OffloadTrainer, tmp_path / "first", max_grad_norm=0.0, save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "first" / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").exists()
    _, resumed_losses, resumed_weights = _train(
        OffloadTrainer, tmp_path / "first", resume=str(checkpoint), max_grad_norm=0.0
    )
    assert resumed_losses[-2:] == full_losses[2:]  # the history before the checkpoint comes with it
    assert_bitwise_equal(full_weights, resumed_weights, "weights after resuming")


def test_fp32_master_weights_through_the_trainer_resume_exactly(tmp_path):
    """A bf16 model with ``optimizer_precision: fp32_master``: fp32 master weights and moments,
    and a checkpoint (saved and loaded by the Trainer) that keeps them fp32 and resumes bit
    for bit."""
    offload = {**OFFLOAD, "optimizer_precision": "fp32_master"}
    kw = {"max_grad_norm": 0.0, "offload": offload, "dtype": torch.bfloat16}
    trainer, full_losses, full_weights = _train(OffloadTrainer, tmp_path / "full", **kw)
    optimizer = trainer.optimizer.optimizer
    state = optimizer.state[next(p for p in trainer.model.parameters())]
    assert state["master"].dtype == torch.float32 and state["exp_avg"].dtype == torch.float32
    assert any("fp32 master weights and moments" in n for n in trainer.offload_report["notes"])
    _train(OffloadTrainer, tmp_path / "first", save_strategy="steps", save_steps=2, **kw)
    resumed, resumed_losses, resumed_weights = _train(
        OffloadTrainer, tmp_path / "first", resume=str(tmp_path / "first" / "checkpoint-2"), **kw
    )
    state = resumed.optimizer.optimizer.state[next(p for p in resumed.model.parameters())]
    assert state["master"].dtype == torch.float32
    assert resumed_losses[-2:] == full_losses[2:]
    assert_bitwise_equal(full_weights, resumed_weights, "weights after resuming")


def test_fp32_master_weights_through_the_trainer_equal_a_hand_written_mixed_precision_adamw(tmp_path):
    """The Trainer with ``optimizer_precision: fp32_master`` on a bf16 model against the plain
    Trainer driving AdamW over fp32 copies: the same losses and weights, bit for bit."""
    from offloadkit.testing import Fp32MasterAdamW

    offload = {**OFFLOAD, "optimizer_precision": "fp32_master"}
    kw = {"max_grad_norm": 0.0, "dtype": torch.bfloat16, "weight_decay": 0.0}
    _, losses, weights = _train(OffloadTrainer, tmp_path / "ours", offload=offload, **kw)
    _, ref_losses, ref_weights = _train(
        transformers.Trainer,
        tmp_path / "ref",
        optimizers_factory=lambda model: (Fp32MasterAdamW(model.parameters(), lr=3e-3, weight_decay=0.0), None),
        **kw,
    )
    assert losses == ref_losses and len(losses) == 4
    assert_bitwise_equal(ref_weights, weights, "weights after training")


def test_compact_state_through_the_trainer_trains_and_resumes_exactly(tmp_path):
    """``optimizer_precision: compact`` on a bf16 model: bf16 moments in host memory, the loss
    goes down, and a checkpoint (with the rounding's random state) resumes bit for bit."""
    offload = {**OFFLOAD, "optimizer_precision": "compact"}
    kw = {"max_grad_norm": 0.0, "offload": offload, "dtype": torch.bfloat16}
    trainer, full_losses, full_weights = _train(OffloadTrainer, tmp_path / "full", **kw)
    optimizer = trainer.optimizer.optimizer
    assert optimizer.defaults["stochastic_rounding"] and not optimizer.defaults["master_weights"]
    state = optimizer.state[next(p for p in trainer.model.parameters())]
    assert state["exp_avg"].dtype == torch.bfloat16 and "master" not in state
    assert any("bf16 moments with stochastically rounded updates" in n for n in trainer.offload_report["notes"])
    assert full_losses[-1] < full_losses[0]
    _train(OffloadTrainer, tmp_path / "first", save_strategy="steps", save_steps=2, **kw)
    _, resumed_losses, resumed_weights = _train(
        OffloadTrainer, tmp_path / "first", resume=str(tmp_path / "first" / "checkpoint-2"), **kw
    )
    assert resumed_losses[-2:] == full_losses[2:]
    assert_bitwise_equal(full_weights, resumed_weights, "weights after resuming")


def test_offload_plan_auto_that_needs_the_state_on_the_host_gives_the_trainer_backward_adamw(tmp_path):
    """``offload_plan: auto`` for a full fine-tune whose GPU budget holds the weights but not
    also the gradients and AdamW state: the plan moves the state to host memory, and the
    Trainer's optimizer is BackwardAdamW (created in create_optimizer from the planned
    config), which then trains. With room on the GPU the state stays there."""
    from offloadkit.optim.options import OptimizerOptions
    from offloadkit.planning import Budgets, plan
    from offloadkit.planning.plan import option

    shape = dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=259,
    )
    roomy = plan(shape, 32, batch=2, lora_rank=0, budgets=Budgets(1 << 30, 1 << 30, 1 << 30))
    assert roomy.fits and not option(roomy.options, OptimizerOptions).enabled
    # Plans that fit and lost only the tie at the hundredth say so (not "slower").
    tied = [reason for name, reason in roomy.rejected if "optimizer state in host memory" in name]
    assert all(r.startswith("as fast to 0.01 s") or "needs" in r for r in tied), tied
    offload = {"offload_plan": "auto", "seq_len": 32, "batch_size": 2, "gpu_budget_bytes": 48 << 20}
    torch.manual_seed(0)
    model = build_llama(shape, attn_implementation="sdpa", dtype=torch.bfloat16)
    trainer = OffloadTrainer(
        model=model,
        args=_args(tmp_path, max_grad_norm=0.0, max_steps=2, warmup_steps=0, learning_rate=1e-3),
        train_dataset=TokenBlocks(byte_tokenizer(), load_texts(), 32),
        offload_config=offload,
    )
    trainer.train()
    plan = trainer.offload_report["plan"]
    assert plan["fits"] and "optimizer state in host memory" in plan["name"], plan
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, BackwardAdamW) and optimizer.updates_in_backward
    assert all(s["exp_avg"].device.type == "cpu" for s in optimizer.state.values())
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and losses[-1] < losses[0]


def test_optimizer_precision_is_checked():
    from offloadkit.config import OffloadConfig

    with pytest.raises(ConfigError, match="optimizer_precision='fp16' is not a precision"):
        OffloadConfig(optimizer_offloading=True, optimizer_precision="fp16").validate()
    with pytest.warns(UserWarning, match="optimizer_precision only applies with optimizer_offloading"):
        OffloadConfig(optimizer_precision="fp32_master").validate()


def test_an_optimizer_that_is_not_adamw_or_sgd_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="replaces the Trainer's AdamW or SGD, but optim='adagrad'"):
        _train(OffloadTrainer, tmp_path, optim="adagrad")


@pytest.mark.parametrize("precision", ["params", "compact"])
def test_the_command_line_trains_with_it(tmp_path, precision):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    (tmp_path / "run.yaml").write_text(
        "model_shape: tiny\nseq_len: 64\nmax_steps: 3\nlora_rank: 0\nmax_grad_norm: 0\n"
        f"optimizer_offloading: true\noptimizer_precision: {precision}\ncompare: false\n"
        f"output_dir: {tmp_path / 'out'}\n"
    )
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run(
        [sys.executable, "-m", "offloadkit", "train", str(tmp_path / "run.yaml")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any("replaced by BackwardAdamW" in n and "updated in backward" in n for n in report["notes"])
    state = "bf16 moments with stochastically rounded updates" if precision == "compact" else "parameters' dtype"
    assert any(state in n for n in report["notes"]), report["notes"]
    memory = report["memory"]
    assert memory["optimizer_state_in_host_memory"] and memory["optimizer_state_bytes"] > 0
    assert "optimizer state in host memory" in report["offload_summary"], report["offload_summary"]
    # Gradients are freed at each parameter's update: at most the largest one is held.
    assert memory["gradients_bytes"] < memory["trainable_parameters_bytes"] / 2


def test_fp16_loss_scaling_defers_the_updates_to_the_scalers_step():
    """Under fp16 the Trainer's GradScaler unscales and checks the gradients at step(): the
    updates wait for it even without clipping (in backward they would apply scaled ones)."""
    from types import SimpleNamespace

    from offloadkit.config import OffloadConfig
    from offloadkit.integrations.optimizer import backward_adamw_for

    model = build_llama("tiny")
    args = transformers.TrainingArguments(output_dir="unused", max_grad_norm=0.0, use_cpu=True, report_to=[])
    trainer = SimpleNamespace(
        args=args,
        model=model,
        accelerator=SimpleNamespace(sync_gradients=True),
        offload_config=OffloadConfig(optimizer_offloading=True),
        get_decay_parameter_names=lambda m: [n for n, _ in m.named_parameters()],
    )
    optimizer, note = backward_adamw_for(trainer)
    assert optimizer.updates_in_backward and "updated in backward" in note
    args.fp16 = True
    optimizer, note = backward_adamw_for(trainer)
    assert not optimizer.updates_in_backward and "fp16 loss scaler" in note
    # Trainable layers resting in files are updated in backward only: refused before the first step.
    streamer = SimpleNamespace(trainable=True, stats=SimpleNamespace(disk_layers=3))
    trainer.offload_runtime = SimpleNamespace(scheduler=None, streamer=streamer)
    with pytest.raises(ConfigError, match="3 trainable layers in files.*fp16 loss scaling"):
        backward_adamw_for(trainer)
    args.fp16, args.max_grad_norm = False, 1.0
    with pytest.raises(ConfigError, match="max_grad_norm=1.0"):
        backward_adamw_for(trainer)
    args.max_grad_norm = 0.0
    assert backward_adamw_for(trainer)[0].updates_in_backward


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_the_trainers_sgd_is_replaced_by_backward_sgd(tmp_path, max_grad_norm):
    from offloadkit.optim import BackwardSGD

    kw = {
        "optim": "sgd",
        "optim_args": "momentum=0.9,nesterov=True",
        "learning_rate": 3e-2,
        "max_grad_norm": max_grad_norm,
    }
    _, ref_losses, ref_weights = _train(transformers.Trainer, tmp_path / "plain", **kw)
    trainer, losses, weights = _train(OffloadTrainer, tmp_path / "ours", **kw)
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, BackwardSGD) and optimizer.updates_in_backward == (max_grad_norm == 0.0)
    assert optimizer.param_groups[0]["momentum"] == 0.9 and optimizer.param_groups[0]["nesterov"]
    assert any("replaced by BackwardSGD" in n for n in trainer.offload_report["notes"])
    assert losses == ref_losses and len(losses) == 4
    assert_bitwise_equal(ref_weights, weights, "weights after training")
    with pytest.raises(ConfigError, match="optimizer_precision='compact' applies to AdamW"):
        _train(OffloadTrainer, tmp_path / "compact", offload={**OFFLOAD, "optimizer_precision": "compact"}, **kw)


def test_optimizer_state_dir_keeps_the_state_in_mapped_files(tmp_path):
    kw = {"max_grad_norm": 0.0}
    _, ref_losses, ref_weights = _train(transformers.Trainer, tmp_path / "plain", **kw)
    offload = {**OFFLOAD, "optimizer_state_dir": str(tmp_path / "state")}
    trainer, losses, weights = _train(OffloadTrainer, tmp_path / "ours", offload=offload, **kw)
    optimizer = trainer.optimizer.optimizer
    assert optimizer.state_dir == str(tmp_path / "state")
    state = next(iter(optimizer.state.values()))
    assert state["exp_avg"].untyped_storage().filename is not None
    assert any("memory-mapped files in" in n for n in trainer.offload_report["notes"])
    assert losses == ref_losses
    assert_bitwise_equal(ref_weights, weights, "weights after training")


def _plain_backward_leaves_the_model_alone(model):
    """A backward outside train(): every gradient stays for the user's own optimizer, and no
    weight moves."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ids = torch.arange(64).remainder(259).view(2, 32)
    model(input_ids=ids, labels=ids).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"{len(missing)} gradients were taken by an update: {missing[:3]}"
    assert_bitwise_equal(before, {n: p.detach().clone() for n, p in model.named_parameters()}, "weights")
    model.zero_grad(set_to_none=True)


def test_the_optimizer_updates_only_inside_train_and_a_second_train_continues_it(tmp_path):
    """The backward hooks live as long as the run: after train() the model is the user's again,
    and a second train() (here with clipping on) continues the same optimizer and state under
    that run's settings, bitwise the plain Trainer's two runs."""
    runs = {}
    for cls in (transformers.Trainer, OffloadTrainer):
        torch.manual_seed(0)
        model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa")
        extra = {"offload_config": OFFLOAD} if cls is OffloadTrainer else {}
        args = _args(tmp_path / cls.__name__, max_grad_norm=0.0, max_steps=3)
        trainer = cls(model=model, args=args, train_dataset=TokenBlocks(byte_tokenizer(), load_texts(), 32), **extra)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        first = trainer.optimizer.optimizer
        if cls is OffloadTrainer:
            assert isinstance(first, BackwardAdamW) and first.updates_in_backward
            _plain_backward_leaves_the_model_alone(model)
        trainer.args.max_grad_norm = 1.0  # the Trainer clips now: updates must wait for it
        trainer.train()
        assert trainer.optimizer.optimizer is first  # as the Trainer keeps its own
        losses += [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[cls] = losses, {n: p.detach().clone() for n, p in model.named_parameters()}
        if cls is OffloadTrainer:
            assert "optimizer state" in trainer.offload_report["prefetch"]["lanes"]  # the second run's scheduler
            _plain_backward_leaves_the_model_alone(model)
    (ref_losses, ref_weights), (losses, weights) = runs[transformers.Trainer], runs[OffloadTrainer]
    assert losses == ref_losses and len(losses) == 6
    assert_bitwise_equal(ref_weights, weights, "weights after two runs")


def test_a_train_that_raises_detaches_the_optimizer(tmp_path):
    class Fail(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("stopped by the test")

    torch.manual_seed(0)
    model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa")
    trainer = OffloadTrainer(
        model=model,
        args=_args(tmp_path, max_grad_norm=0.0),
        train_dataset=TokenBlocks(byte_tokenizer(), load_texts(), 32),
        callbacks=[Fail()],
        offload_config=OFFLOAD,
    )
    with pytest.raises(RuntimeError, match="stopped by the test"):
        trainer.train()
    assert isinstance(trainer.optimizer.optimizer, BackwardAdamW)
    _plain_backward_leaves_the_model_alone(model)


def test_a_layer_shared_under_reentrant_checkpointing_and_tied_weights_match_the_trainers_adamw(tmp_path):
    """Two decoder layers that are one module, each checkpointed reentrantly (its weights get
    their gradient in two pieces, updated at step()), and a head tied to the embedding (one
    gradient, updated in backward): bitwise the Trainer's own AdamW."""
    runs = {}
    for cls in (transformers.Trainer, OffloadTrainer):
        torch.manual_seed(0)
        model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa", tie_word_embeddings=True)
        model.model.layers[1] = model.model.layers[0]
        extra = {"offload_config": OFFLOAD} if cls is OffloadTrainer else {}
        args = _args(
            tmp_path / cls.__name__,
            max_grad_norm=0.0,
            activation_checkpointing=True,
            activation_checkpointing_kwargs={"use_reentrant": True},
        )
        trainer = cls(model=model, args=args, train_dataset=TokenBlocks(byte_tokenizer(), load_texts(), 32), **extra)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[cls] = losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert trainer.optimizer.optimizer.updates_in_backward
    (ref_losses, ref_weights), (losses, weights) = runs[transformers.Trainer], runs[OffloadTrainer]
    assert losses == ref_losses and len(losses) == 4
    assert_bitwise_equal(ref_weights, weights, "weights after training")
