"""Plans that hold what the run will hold: a full fine-tune's gradients when clipping defers
the updates to ``step()``, only the optimizers the run can replace, and the depth of the
model as built."""

from dataclasses import replace

import pytest
import torch

from offloadkit.checkpointing.footprint import keeps_attention
from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import OptionSet
from offloadkit.layers.options import StreamingOptions
from offloadkit.optim.options import OptimizerOptions
from offloadkit.planning import Budgets, estimate_memory, estimate_time, plan
from offloadkit.planning.plan import input_counts, option
from offloadkit.storage.options import BudgetOptions
from offloadkit.testing import build_llama

transformers = pytest.importorskip("transformers")

GiB = 1 << 30


def _in_backward():
    from offloadkit.planning import OptimizerSetup

    return OptimizerSetup(updates_in_backward=True, source="max_grad_norm=0")


def _largest(shape) -> int:
    return max(max(a * c for a, c in shape.linears), shape.embed_params, shape.head_params)


def test_clipping_holds_every_gradient_until_step():
    """The 8B full fine-tune at 128K tokens on 48 GiB: with the Trainer's clipping (the
    default) the plan counts every bf16 gradient on the GPU until step(), and its reservation
    still fits; without clipping, one parameter's gradient at a time. The plan that counted
    one gradient under clipping would have needed 62.8 GiB."""
    budgets = Budgets(48 * GiB, 108 * GiB, 200 * GiB)
    clipped = plan("llama-3-8b", 131072, lora_rank=0, budgets=budgets)
    shape = clipped.workload.shape
    state = shape.params * 4  # two bf16 moments
    in_flight = 2 * (1 << 30) + _largest(shape) * 4  # two 1 GiB copy windows and one parameter's state
    assert option(clipped.options, OptimizerOptions).enabled and state > in_flight
    assert clipped.memory.gpu_parts["trainable state"] == shape.params * 2 + in_flight
    assert clipped.fits and clipped.memory.gpu_reserved <= budgets.gpu_bytes
    free = plan("llama-3-8b", 131072, lora_rank=0, budgets=budgets, optimizer=_in_backward())
    assert option(free.options, OptimizerOptions).enabled
    assert free.memory.gpu_parts["trainable state"] == _largest(shape) * 2 + in_flight
    assert not clipped.workload.updates_in_backward and free.workload.updates_in_backward
    # The plan made for updates in backward, run with clipping: every gradient on top.
    run = estimate_memory(replace(free.workload, updates_in_backward=False), free.options)
    assert run.gpu_peak - free.memory.gpu_peak == (shape.params - _largest(shape)) * 2
    assert round(run.gpu_reserved / GiB, 1) == 62.8 and run.gpu_reserved > budgets.gpu_bytes
    assert "updates at step(), every gradient held until then" in clipped.table()


def test_deferred_updates_move_the_state_after_backward():
    """Deferred to step(), the state's trip each way is no longer hidden behind backward."""
    budgets = Budgets(48 * GiB, 108 * GiB, 200 * GiB)
    free = plan("llama-3-8b", 131072, lora_rank=0, budgets=budgets, optimizer=_in_backward())
    w, f = free.workload, free.options
    assert not option(f, StreamingOptions).enabled
    deferred = estimate_time(replace(w, updates_in_backward=False), f, budgets.rates, free.placement)
    state = w.shape.params * w.optimizer_state_bytes
    assert deferred.seconds - free.time.seconds == pytest.approx(state / budgets.rates.pcie_bytes_per_s)


def _trainer_args(tmp_path, **kw):
    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)


@pytest.mark.parametrize(
    "kw,in_backward",
    [
        ({}, False),  # the Trainer's default: max_grad_norm=1.0
        ({"max_grad_norm": 0.0}, True),
        ({"max_grad_norm": 0.0, "gradient_accumulation_steps": 4}, False),
    ],
)
def test_the_trainer_tells_the_plan_when_its_optimizer_updates(tmp_path, kw, in_backward):
    """The mixin's plan assumes what BackwardAdamW will do under the Trainer's arguments:
    clipping and accumulation hold every gradient until step()."""
    from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    class OffloadTrainer(ActivationOffloadingMixin, transformers.Trainer):
        pass

    args = _trainer_args(tmp_path, max_steps=1, per_device_train_batch_size=2, save_strategy="no", **kw)
    trainer = OffloadTrainer(
        model=build_llama("tiny", vocab_size=259, attn_implementation="sdpa"),
        args=args,
        train_dataset=TokenBlocks(byte_tokenizer(), load_texts(), 32),
        offload_config={"offload_plan": "auto", "seq_len": 32, "batch_size": 2, "host_budget_bytes": GiB},
    )
    trainer.train()
    assert trainer.offload_report["plan"]["updates_in_backward"] is in_backward


def test_plain_prepare_assumes_the_trainers_clipping():
    from offloadkit.compose import prepare

    model = build_llama("tiny", attn_implementation="sdpa")
    runtime = prepare(model, {"offload_plan": "auto", "host_budget_bytes": "1GiB"}, seq_len=64)
    try:
        assert runtime.plan.workload.updates_in_backward is False
    finally:
        runtime.close()
    runtime = prepare(
        model, {"offload_plan": "auto", "host_budget_bytes": "1GiB"}, seq_len=64, optimizer=_in_backward()
    )
    try:
        assert runtime.plan.workload.updates_in_backward is True
        assert runtime.report()["plan"]["updates_in_backward"] is True
    finally:
        runtime.close()


def test_cli_plan_assumes_clipping_and_takes_max_grad_norm():
    from offloadkit.cli.main import build_parser
    from offloadkit.cli.plan import run_plan

    def run(*extra):
        lines: list[str] = []
        argv = ["plan", "--shape", "llama-3-8b", "--seq-len", "131072", "--lora-rank", "0", "--no-search"]
        argv += ["--gpu-gib", "48", "--host-gib", "108", "--disk-gib", "200", "--verbose", *extra]
        run_plan(build_parser().parse_args(argv), log=lines.append)
        return "\n".join(lines)

    budgets = Budgets(48 * GiB, 108 * GiB, 200 * GiB)
    clipped = plan("llama-3-8b", 131072, lora_rank=0, budgets=budgets)
    free = plan("llama-3-8b", 131072, lora_rank=0, budgets=budgets, optimizer=_in_backward())
    out = run()
    assert f"| GPU peak allocated | {clipped.memory.gpu_peak / GiB:.2f} GiB" in out
    assert "updates at step(), every gradient held until then (--max-grad-norm 1, the Trainer's default)" in out
    out = run("--max-grad-norm", "0")
    assert f"| GPU peak allocated | {free.memory.gpu_peak / GiB:.2f} GiB" in out
    assert "updated in backward, one gradient held at a time" in out
    assert clipped.memory.gpu_peak != free.memory.gpu_peak


SMALL = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=259,
)


def _planned_trainer(tmp_path, optim, optimizers=None):
    """A bf16 full fine-tune whose 48 MiB GPU budget holds the weights but not also the
    gradients and AdamW state (with AdamW the plan moves the state to the host), trained two
    steps; returns the trainer, the plan prepare() applied and the losses."""
    from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    class Recording(ActivationOffloadingMixin, transformers.Trainer):
        def create_optimizer(self, *args, **kwargs):
            self.applied_plan = self.offload_runtime.plan
            return super().create_optimizer(*args, **kwargs)

    model = build_llama(SMALL, attn_implementation="sdpa", dtype=torch.bfloat16)
    extra = {"optimizers": optimizers(model)} if optimizers else {}
    args = _trainer_args(
        tmp_path,
        optim=optim,
        max_grad_norm=0.0,
        max_steps=2,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
    )
    trainer = Recording(
        model=model,
        args=args,
        train_dataset=TokenBlocks(byte_tokenizer(), load_texts(), 32),
        offload_config={"offload_plan": "auto", "seq_len": 32, "batch_size": 2, "gpu_budget_bytes": 48 << 20},
        **extra,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, trainer.applied_plan, losses


@pytest.mark.parametrize(
    "optim,optimizers",
    [
        ("adafactor", None),
        ("adamw_torch", lambda model: (torch.optim.AdamW(model.parameters(), lr=1e-3), None)),
    ],
    ids=["adafactor", "given-adamw"],
)
def test_a_trainer_whose_optimizer_cannot_be_replaced_is_planned_with_its_state_on_the_gpu(tmp_path, optim, optimizers):
    """Adafactor, or an optimizer passed to the Trainer: nothing can replace it, so the plan
    never offers the state in host memory (it would fail at create_optimizer, or leave the
    state on the GPU it was not counted on); it counts gradients and state on the GPU, and
    training runs."""
    trainer, applied, losses = _planned_trainer(tmp_path, optim, optimizers)
    assert not option(applied.options, OptimizerOptions).enabled and not applied.optimizer.replaceable
    params = applied.workload.shape.params
    assert applied.memory.gpu_parts["trainable state"] == params * (2 + 4)  # bf16 gradients and moments
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_the_trainers_own_adamw_still_moves_its_state_to_the_host(tmp_path):
    from offloadkit.optim import BackwardAdamW

    trainer, applied, losses = _planned_trainer(tmp_path, "adamw_torch")
    assert option(applied.options, OptimizerOptions).enabled and applied.fits
    assert isinstance(trainer.optimizer.optimizer, BackwardAdamW) and len(losses) == 2


def test_plain_prepare_moves_the_optimizer_state_only_when_asked():
    """Without a Trainer nothing replaces the loop's optimizer: the plan keeps the state on
    the GPU unless ``optimizer_offloading: true`` says the loop steps BackwardAdamW."""
    from offloadkit.compose import prepare

    model = build_llama(SMALL, attn_implementation="sdpa", dtype=torch.bfloat16)
    config = {"offload_plan": "auto", "seq_len": 32, "batch_size": 2, "gpu_budget_bytes": 48 << 20}
    for asked in (False, True):
        runtime = prepare(model, dict(config, optimizer_offloading=asked), optimizer=None)
        try:
            assert option(runtime.plan.options, OptimizerOptions).enabled is asked
            assert runtime.plan.optimizer.replaceable is asked
        finally:
            runtime.close()


def _step(runtime, model, seq):
    ids = torch.randint(0, 256, (1, seq))
    with runtime.context():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def test_offload_plan_auto_plans_the_layers_the_model_has():
    """A model cut to 2 of the 6 decoder layers its config names: the plan is made for the 2
    layers built (one block-input place each), and the step runs."""
    from offloadkit.compose import prepare

    model = build_llama("tiny", num_hidden_layers=6, attn_implementation="sdpa")
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:2])
    assert model.config.num_hidden_layers == 6
    config = {"offload_plan": "auto", "gpu_budget_bytes": 32 << 20, "host_budget_bytes": "1GiB"}
    runtime = prepare(model, config, seq_len=8192)
    try:
        p = runtime.plan
        assert p.workload.shape.layers == 2 and p.placement == ["ram", "gpu"] and p.fits
        assert runtime.config.block_input_placement == ("ram", "gpu")
        assert torch.isfinite(_step(runtime, model, 8192))
    finally:
        runtime.close()


def test_a_deeper_plan_is_realised_at_the_depth_built():
    """As the context-parallel benchmark does: a plan for the full depth, a model of fewer
    layers. Its config is refused before anything is attached; the plan realised at the
    model's depth (one place per layer built, the same options) runs."""
    from offloadkit.compose import prepare
    from offloadkit.config import ConfigError
    from offloadkit.models.blocks import find_blocks
    from offloadkit.planning import OptimizerSetup, resolve_shape

    budgets = Budgets(32 << 20, GiB, GiB)
    full = plan(
        resolve_shape("tiny", layers=6),
        8192,
        lora_rank=0,
        dtype_bytes=4,
        budgets=budgets,
        optimizer=OptimizerSetup(replaceable=False),
    )
    assert full.placement == ["ram"] * 5 + ["gpu"]
    model = build_llama("tiny", num_hidden_layers=2, attn_implementation="sdpa")
    with pytest.raises(ConfigError, match="block_input_placement has 6 places, but the model has 2 decoder layers"):
        prepare(model, full.to_config())
    assert not [name for name, m in model.named_modules() if "forward" in vars(m)], "nothing was attached"
    built = full.at_depth(len(find_blocks(model)))
    assert built.placement == ["ram", "gpu"] and built.workload.shape.layers == 2
    assert input_counts(built.workload, built.options) == input_counts(full.workload, full.options)
    kept = keeps_attention(full.workload, OptionSet(full.options))
    assert keeps_attention(built.workload, OptionSet(built.options)) == min(kept, 2)
    placed = (CheckpointOptions, BudgetOptions)  # where block inputs wait, and the cap for that
    assert [o for o in built.options if type(o) not in placed] == [o for o in full.options if type(o) not in placed]
    # The GPU holds what the full plan holds: the same per-layer working set and block inputs.
    for part in ("layer recompute", "layer backward", "block inputs"):
        assert built.memory.gpu_parts[part] == full.memory.gpu_parts[part], part
    runtime = prepare(model, built.to_config())
    try:
        assert runtime.checkpointing is not None and runtime.config.block_input_placement == ("ram", "gpu")
        assert torch.isfinite(_step(runtime, model, 8192))
    finally:
        runtime.close()
