"""One rank of the updates-in-backward checks under data parallelism, started by ``torchrun``:
BackwardAdamW / BackwardSGD under DDP, FSDP2 and context parallelism against ``torch.optim``
under the same wrapper, bitwise, with replicas equal across ranks. Prints one
``RESULT <check> rank=<r> ok`` line per check.

On CPU over gloo by default; with ``OFFLOADKIT_TEST_DEVICE=cuda``, one GPU per rank over NCCL,
deterministic kernels (the test sets ``CUBLAS_WORKSPACE_CONFIG``). Context parallelism on CUDA
runs ring attention, whose 16-bit kernels' backward is not deterministic: there the replicas
must be equal and the weights within a tolerance of the reference."""

import contextlib
import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from offloadkit.optim import BackwardAdamW, BackwardSGD
from offloadkit.testing import build_llama, make_batch


def report(check, rank):
    sys.stdout.write(f"RESULT {check} rank={rank} ok\n")  # one write: ranks share the pipe
    sys.stdout.flush()


DEVICE = os.environ.get("OFFLOADKIT_TEST_DEVICE", "cpu")


def build(*args, **kw):
    if DEVICE == "cuda":
        kw.setdefault("attn_implementation", "eager")  # deterministic backward
    return build_llama(*args, **kw).to(DEVICE)


def batch_for(rank, step, seq=32):
    return make_batch(256, 2, seq, seed=100 * step + rank, device=DEVICE)


def same_on_every_rank(params, what):
    """Every rank's parameters equal rank 0's, bit for bit."""
    for p in params:
        mine = p.detach().clone()
        theirs = mine.clone()
        dist.broadcast(theirs, 0)
        assert torch.equal(mine, theirs), f"{what}: replicas differ"


def equal(a, b, what):
    for (name, p), q in zip(a, b):
        assert torch.equal(p.detach(), q.detach()), f"{what}: {name} differs by {(p - q).abs().max().item():.3g}"


def ddp_runs(make_opt, *, steps=3, accumulate=1, clip=None, ddp_kw=None, route=True):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    base = build("tiny")
    results = []
    for ours in (False, True):
        ids = [torch.cuda.current_device()] if DEVICE == "cuda" else None
        model = DDP(copy.deepcopy(base), device_ids=ids, **(ddp_kw or {}))
        opt = make_opt(model.parameters(), ours)
        if ours and route:
            opt.reduce_with_ddp(model)
        for step in range(steps):
            for micro in range(accumulate):
                last = micro == accumulate - 1
                ctx = model.no_sync() if not last else contextlib.nullcontext()
                accumulating = opt.accumulating() if (ours and not last) else contextlib.nullcontext()
                with ctx, accumulating:
                    loss = model(**batch_for(rank, 10 * step + micro)).loss / accumulate
                    loss.backward()
            if clip is not None and not ours:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        results.append(model)
    ref, mine = results
    equal(ref.module.named_parameters(), mine.module.parameters(), "DDP")
    same_on_every_rank(mine.module.parameters(), "DDP")
    return mine


def adamw(params, ours, **kw):
    return (
        BackwardAdamW(params, lr=1e-2, foreach=False, **kw)
        if ours
        else torch.optim.AdamW(params, lr=1e-2, foreach=False)
    )


def sgd(params, ours):
    kw = dict(lr=0.05, momentum=0.9, foreach=False)
    return BackwardSGD(params, **kw) if ours else torch.optim.SGD(params, **kw)


def check_ddp(rank, world):
    ddp_runs(adamw)
    report("ddp-adamw", rank)
    ddp_runs(sgd)
    report("ddp-sgd", rank)
    ddp_runs(adamw, ddp_kw={"gradient_as_bucket_view": True, "bucket_cap_mb": 1})
    report("ddp-bucket-view", rank)
    ddp_runs(lambda params, ours: adamw(params, ours, max_grad_norm=0.5) if ours else adamw(params, False), clip=0.5)
    report("ddp-clip", rank)
    ddp_runs(adamw, accumulate=2)
    report("ddp-accumulate", rank)
    ddp_runs(adamw, ddp_kw={"find_unused_parameters": True})
    report("ddp-unused", rank)

    # Not told how gradients are reduced: the first update in backward is refused, nothing moved.
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(build("tiny"), device_ids=[torch.cuda.current_device()] if DEVICE == "cuda" else None)
    before = [p.detach().clone() for p in model.parameters()]
    BackwardAdamW(model.parameters(), lr=1e-2)  # its hooks live as long as the parameters
    try:
        model(**batch_for(rank, 0)).loss.backward()
        raise AssertionError("an update with this rank's own gradient must be refused")
    except RuntimeError as exc:
        assert "reduce_with_ddp" in str(exc), exc
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a weight moved before the refusal"
    report("ddp-unsaid", rank)


def sharded(base):
    """A copy of ``base`` under FSDP2: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def same_as_reference(models, what):
    """The second model's full weights bitwise the first's, and equal on every rank."""
    full = [[p.full_tensor() for p in m.parameters()] for m in models]
    equal(zip(range(len(full[0])), full[0]), full[1], what)
    same_on_every_rank(full[1], what)


def check_fsdp2(rank, world):
    torch.manual_seed(0)
    base = build("tiny")
    for name, make, clip in (("adamw", adamw, None), ("sgd", sgd, None), ("clip", adamw, 0.5)):
        models = []
        for ours in (False, True):
            model = sharded(base)
            opt = (
                make(model.parameters(), ours)
                if clip is None or not ours
                else adamw(model.parameters(), True, max_grad_norm=clip)
            )
            for step in range(3):
                model(**batch_for(rank, step)).loss.backward()
                if ours and clip is None:
                    # Updated in backward, on FSDP2's post-reduce stream: no gradient is left.
                    left = [n for n, p in model.named_parameters() if p.grad is not None]
                    assert not left, f"FSDP2 {name}: not updated in backward: {left[:3]}"
                if clip is not None and not ours:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if ours and clip is None:
                # Updated in backward, from the reduce-scattered shard: state the size of the shard.
                some = next(p for p in model.parameters() if p.dim() == 2)
                assert opt.state[some]["exp_avg" if make is adamw else "momentum_buffer"].shape == some.to_local().shape
            models.append(model)
        same_as_reference(models, f"FSDP2 {name}")
        report(f"fsdp2-{name}", rank)
    fsdp2_accumulation(base, rank)


def fsdp2_accumulation(base, rank):
    """Gradient accumulation over 2 micro-steps under FSDP2, the two ways users write it:
    reduce-scattering every micro-step inside ``opt.accumulating()``, or FSDP2's
    ``set_requires_gradient_sync(False)`` on the first (nothing reduced, so nothing to update,
    until the last). Either way one update a step, from the summed gradient, as torch AdamW."""
    for how in ("accumulating", "no-sync"):
        models = []
        for ours in (False, True):
            model = sharded(base)
            opt = adamw(model.parameters(), ours)
            for step in range(2):
                for micro in range(2):
                    last = micro == 1
                    if how == "no-sync":
                        model.set_requires_gradient_sync(last)
                    held = opt.accumulating() if ours and how == "accumulating" and not last else contextlib.nullcontext()
                    with held:
                        (model(**batch_for(rank, 10 * step + micro)).loss / 2).backward()
                    if ours and last:
                        left = [n for n, p in model.named_parameters() if p.grad is not None]
                        assert not left, f"FSDP2 accumulation ({how}): not updated in backward: {left[:3]}"
                opt.step()
                opt.zero_grad(set_to_none=True)
            models.append(model)
        same_as_reference(models, f"FSDP2 accumulation ({how})")
        report(f"fsdp2-accumulate-{how}", rank)


def check_cp(rank, world):
    from offloadkit.parallel import apply_context_parallel

    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # ring attention's 16-bit kernels
    base = build("tiny", attn_implementation="sdpa", num_key_value_heads=2, dtype=dtype)
    for name, clip in (("adamw", None), ("clip", 0.5)):
        models = []
        for ours in (False, True):
            model = copy.deepcopy(base)
            cp = apply_context_parallel(model)
            opt = adamw(model.parameters(), ours, max_grad_norm=clip) if ours else adamw(model.parameters(), False)
            if ours:
                cp.attach_optimizer(opt)
            for step in range(3):
                batch = make_batch(256, 2, 64, seed=7 + step, device=DEVICE)  # the same sequence on every rank
                with cp.step(batch["input_ids"], batch["labels"]) as inputs:
                    model(**inputs).loss.backward()
                cp.reduce_gradients()  # a no-op for the attached optimizer's parameters
                if clip is not None and not ours:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
            cp.remove()
            models.append(model)
        if DEVICE == "cuda":
            for (pname, a), b in zip(models[0].named_parameters(), models[1].parameters()):
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=f"context parallel {name}: {pname}")
        else:
            equal(models[0].named_parameters(), models[1].parameters(), f"context parallel {name}")
        same_on_every_rank(models[1].parameters(), f"context parallel {name}")
        report(f"cp-{name}", rank)


def _trained(cls, offload_cls, model, args, offload_config: dict, callbacks=None):
    """``cls`` (the plain Trainer, or ``offload_cls`` given ``offload_config`` and ``callbacks``)
    trained on the byte-tokenized sample texts in blocks of 32."""
    from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts

    extra = {"offload_config": offload_config, "callbacks": callbacks} if cls is offload_cls else {}
    trainer = cls(model=model, args=args, train_dataset=TokenBlocks(byte_tokenizer(), load_texts(), 32), **extra)
    trainer.train()
    return trainer


def check_trainer(rank, world):
    """The Trainer mixin under DDP (torchrun, gloo): optimizer_offloading replaces AdamW with
    BackwardAdamW, which updates from DDP's reduced gradients: weights bitwise the Trainer's."""
    import transformers

    from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    class OffloadTrainer(ActivationOffloadingMixin, transformers.Trainer):
        pass

    out = tempfile.mkdtemp(prefix=f"offloadkit-ddp-trainer-{rank}-")
    for unused in (False, None):  # None: the Trainer's default, find_unused_parameters=True for this model
        _trainer_pair(transformers, OffloadTrainer, TokenBlocks, byte_tokenizer, load_texts, out, unused)
        report(f"trainer-ddp-unused-{unused}", rank)


def _trainer_pair(transformers, OffloadTrainer, TokenBlocks, byte_tokenizer, load_texts, out, unused):
    weights = []
    for cls in (transformers.Trainer, OffloadTrainer):
        torch.manual_seed(0)
        model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa")
        args = transformers.TrainingArguments(
            output_dir=os.path.join(out, cls.__name__),
            per_device_train_batch_size=2,
            max_steps=3,
            learning_rate=3e-3,
            max_grad_norm=0.0,
            optim="adamw_torch",
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            seed=0,
            remove_unused_columns=False,
            logging_steps=1,
            ddp_find_unused_parameters=unused,
        )
        extra = (
            {"offload_config": {"optimizer_offloading": True, "activation_offloading": False}}
            if cls is OffloadTrainer
            else {}
        )
        trainer = cls(model=model, args=args, train_dataset=TokenBlocks(byte_tokenizer(), load_texts(), 32), **extra)
        trainer.train()
        if cls is OffloadTrainer:
            opt = trainer.optimizer.optimizer
            assert isinstance(opt, BackwardAdamW), type(opt)
            assert opt.updates_in_backward == (unused is False)
            assert (opt._ddp is not None) == (unused is False), type(trainer.model_wrapped)
        weights.append(list(model.named_parameters()))
    equal(weights[0], [p for _, p in weights[1]], "Trainer under DDP")
    same_on_every_rank([p for _, p in weights[1]], "Trainer under DDP")


def check_trainer_fsdp2(rank, world):
    """The Trainer mixin under the Trainer's own FSDP2 (``fsdp_config`` version 2, one GPU a
    rank): checkpointing with its inputs offloaded and optimizer_offloading (BackwardAdamW on
    FSDP2's sharded parameters, updated from the reduce-scattered shard in backward); weights
    those of the plain Trainer with FSDP2 and checkpointing (eager attention), replicas equal.
    Once with one micro-step a step, once accumulating gradients over two."""
    assert DEVICE == "cuda", "accelerate's FSDP2 runs on GPUs"
    import transformers

    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    class OffloadTrainer(ActivationOffloadingMixin, transformers.Trainer):
        pass

    class GradientsLeft(transformers.TrainerCallback):
        """How many parameters still hold a gradient when the optimizer step comes."""

        def __init__(self):
            self.counts = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.counts.append(sum(p.grad is not None for p in model.parameters()))

    for accumulation in (1, 2):
        left = GradientsLeft()
        out = tempfile.mkdtemp(prefix=f"offloadkit-fsdp2-trainer-{rank}-")
        results = []
        for cls in (transformers.Trainer, OffloadTrainer):
            torch.manual_seed(0)
            model = build_llama("tiny", vocab_size=259, attn_implementation="eager")
            args = transformers.TrainingArguments(
                output_dir=os.path.join(out, cls.__name__), per_device_train_batch_size=2, max_steps=3,
                gradient_accumulation_steps=accumulation, learning_rate=3e-3, max_grad_norm=0.0,
                optim="adamw_torch", save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                remove_unused_columns=False, logging_steps=1, gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": False}, fsdp="full_shard auto_wrap",
                fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
            )  # fmt: skip
            offload = {"gradient_checkpointing": True, "activation_offloading": True, "optimizer_offloading": True}
            trainer = _trained(cls, OffloadTrainer, model, args, offload, callbacks=[left])
            params = list(trainer.model.parameters())
            assert all(type(p).__name__ == "DTensor" for p in params), "the Trainer sharded the model with FSDP2"
            if cls is OffloadTrainer:
                opt = trainer.optimizer
                opt = getattr(opt, "optimizer", opt)
                assert isinstance(opt, BackwardAdamW) and opt.updates_in_backward, type(opt)
                some = next(p for p in params if p.dim() == 2)
                assert opt.state[some]["exp_avg"].shape == some.to_local().shape, "state the size of the shard"
                assert trainer.offload_report["activations"]["offloaded_bytes"] > 0, trainer.offload_report
                # The sharded parameters Accelerate gave the optimizer were updated in backward,
                # once a step: after the last micro-step's reduction.
                assert left.counts == [0, 0, 0], left.counts
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            results.append((losses, [p.full_tensor().detach().clone() for p in params]))
        (ref_losses, ref_weights), (losses, weights) = results
        # The Trainer's AdamW on CUDA is torch's foreach implementation, BackwardAdamW updates
        # one parameter at a time: equal arithmetic, not always the same rounding.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for a, b in zip(weights, ref_weights):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        same_on_every_rank(weights, f"Trainer under FSDP2, {accumulation} micro-steps a step")
        report("trainer-fsdp2" if accumulation == 1 else "trainer-fsdp2-accumulate", rank)


def check_trainer_cp(rank, world):
    """``context_parallel: true`` through the Trainer mixin: every rank's batch in turn, each
    split over the ranks; weights after three SGD steps those of the plain Trainer under DDP
    (the CPU path's attention over all-gathered keys sums in another order: close, not equal)."""
    import transformers

    from offloadkit.integrations.trainer import ActivationOffloadingMixin
    from offloadkit.parallel.turns import batches_in_turn

    # Each rank's batch of its own length comes back to every rank, padded alike.
    own = torch.full((1, 5 + 3 * rank), rank + 1)
    turns = list(batches_in_turn(dist.group.WORLD, own, own.clone()))
    for turn, ids, labels in turns:
        length = 5 + 3 * turn
        assert ids.shape == (1, -(-length // (2 * world)) * 2 * world), ids.shape
        assert bool((ids[0, :length] == turn + 1).all()) and bool((labels[0, length:] == -100).all())

    class OffloadTrainer(ActivationOffloadingMixin, transformers.Trainer):
        pass

    out = tempfile.mkdtemp(prefix=f"offloadkit-cp-trainer-{rank}-")
    for offload_optimizer, accumulation in ((False, 1), (True, 2)):
        _trainer_cp_pair(transformers, OffloadTrainer, out, rank, world, offload_optimizer, accumulation)
    report("trainer-cp", rank)


def _trainer_cp_pair(transformers, OffloadTrainer, out, rank, world, offload_optimizer, accumulation):
    """The plain Trainer under DDP against the mixin with context_parallel (and, with
    ``offload_optimizer``, BackwardSGD updating from DDP's reduction in the last turn)."""
    results = []
    for cls in (transformers.Trainer, OffloadTrainer):
        torch.manual_seed(0)
        model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa", num_key_value_heads=2)
        args = transformers.TrainingArguments(
            output_dir=os.path.join(out, f"{cls.__name__}-{accumulation}"), per_device_train_batch_size=2,
            max_steps=3, learning_rate=0.1, optim="sgd", max_grad_norm=0.0, save_strategy="no", report_to=[],
            disable_tqdm=True, use_cpu=True, seed=0, remove_unused_columns=False, logging_steps=1,
            ddp_find_unused_parameters=False, gradient_accumulation_steps=accumulation,
        )  # fmt: skip
        offload = {"context_parallel": True, "activation_offloading": False, "optimizer_offloading": offload_optimizer}
        trainer = _trained(cls, OffloadTrainer, model, args, offload)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if cls is OffloadTrainer:
            assert trainer.offload_report["context_parallel"] == {"ranks": world}, trainer.offload_report
            if offload_optimizer:
                opt = trainer.optimizer.optimizer
                assert type(opt).__name__ == "BackwardSGD" and opt._ddp is not None, type(opt)
            assert model.config._attn_implementation == "sdpa", "the model's attention is given back after train()"
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (ref_losses, ref_weights), (losses, weights) = results
    assert len(losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for a, b in zip(weights, ref_weights):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    same_on_every_rank(weights, "Trainer under context parallelism")


if __name__ == "__main__":
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.use_deterministic_algorithms(True, warn_only=True)  # ring attention has no deterministic backward
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    passed = False
    try:
        for name in sys.argv[1:]:
            globals()[f"check_{name}"](dist.get_rank(), dist.get_world_size())
        # Every rank past its last collective before the group goes: a rank tearing gloo down
        # while the other still exchanges aborted once (SIGABRT after every check had passed).
        dist.barrier()
        passed = True
    finally:
        dist.destroy_process_group()
    if passed:
        # Leave without the interpreter's teardown: a library thread still joinable when its
        # static destructors run aborted a rank twice in CI ("terminate called without an
        # active exception"), each time after every check had passed and reported.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
