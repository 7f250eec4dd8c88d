"""One rank of the wrapper x feature matrix, started by ``torchrun`` (gloo, CPU): each feature
under DDP or FSDP2 (``fully_shard`` per decoder layer, then the root) against the same wrapper
without it, two steps on a tiny Llama, each rank its own batch. Prints one
``RESULT <wrapper>-<check> rank=<r> ok`` line per check, ``SKIP <wrapper>-<check> ...`` where
an optional dependency (peft) is missing.

Each run is compared step by step with its reference: the loss, then the gradients (an SGD step
applies them) or, for an optimizer that updates in backward, the weights after each step.
Bitwise where the feature does the same arithmetic (offloading only moves saved tensors; a
checkpoint's recompute and a streamed layer run the same kernels on the same values); within
``TOL`` where it sums in another order (chunked loss, tiled MLP). After the updates every rank
holds rank 0's weights, bit for bit.

Features are attached before the wrapper (``prepare()`` also after it, in ``together-after``).
Under FSDP2 the combinations that cannot run are refused before the first step
(``offloadkit/parallel/compat.py``): ``fsdp2-refused`` checks that on both ranks."""

import contextlib
import copy
import functools
import sys
import tempfile

import torch
import torch.distributed as dist

from offloadkit import get_act_offloading_ctx_manager
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.models.blocks import find_blocks
from offloadkit.optim import BackwardAdamW
from offloadkit.storage.disk import DiskOptions
from offloadkit.testing import build_llama, make_batch, randomize_lora_b
from offloadkit.testing.cpu_streaming import stream_layers_on_cpu

STEPS = 2
LR = 0.1
# Chunked loss and tiled MLP sum the same terms in another order (the loss over token chunks;
# the MLP's weight gradients over token shards): fp32 rounding differs in the last bits. Seen
# here: the loss within 9e-8 relative, gradients and weights within 3e-8 absolute. 1e-5
# relative with 1e-7 absolute (for values near zero) leaves room for other CPUs and BLAS builds
# and still catches a lost or doubled contribution (a whole shard's is 1e-3 of a gradient or more).
TOL = dict(rtol=1e-5, atol=1e-7)
# Adam divides each gradient by its running magnitude plus eps: with the default eps (1e-8) a
# gradient near 1e-8 that another summation order rounds differently moves its weight by a
# different fraction of lr (up to 1e-4 here). With eps=1e-3 a gradient's difference d moves a
# weight by at most lr * d / eps = 10 d, which TOL bounds. Both sides of a check use the same eps.
ROUND_EPS = 1e-3


def report(line):
    sys.stdout.write(line + "\n")  # one write: the ranks share the pipe
    sys.stdout.flush()


def full(t):
    """A DTensor's full value (a collective: every rank calls it in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def wrap(model, wrapper):
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for _, layer in find_blocks(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def inner(model):
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def batch_for(rank, step):
    return make_batch(256, 2, 32, seed=100 * step + rank)


class Run:
    """One training run: the wrapped model, its optimizer (SGD by default) and what to enter
    around each forward; ``train()`` records the loss, the gradients and the weights of each
    step, then removes the handles (each may first assert that it did something)."""

    def __init__(self, model, opt=None, ctx=None, handles=(), updates_in_backward=False):
        self.model = model
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = opt if opt is not None else torch.optim.SGD(trainable, lr=LR, foreach=False)
        self.ctx = ctx
        self.handles = list(handles)
        self.updates_in_backward = updates_in_backward

    def train(self, rank):
        record = []
        for step in range(STEPS):
            self.opt.zero_grad(set_to_none=True)
            with self.ctx if self.ctx is not None else contextlib.nullcontext():
                loss = self.model(**batch_for(rank, step)).loss
            loss.backward()
            grads = None
            if not self.updates_in_backward:
                grads = [(n, full(p.grad)) for n, p in inner(self.model).named_parameters() if p.grad is not None]
            self.opt.step()
            weights = [(n, full(p.detach())) for n, p in inner(self.model).named_parameters()]
            record.append((loss.detach(), grads, weights))
        for h in self.handles:
            h()
        return record


def compare(what, ref, got, tol):
    def same(a, b, name):
        if tol is None:
            assert torch.equal(a, b), f"{what}: {name} differs by {(a - b).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(b, a, **tol, msg=lambda m: f"{what}: {name}: {m}")

    for step, ((loss_a, grads_a, w_a), (loss_b, grads_b, w_b)) in enumerate(zip(ref, got)):
        same(loss_a, loss_b, f"step {step} loss")
        if grads_a is not None and grads_b is not None:
            assert [n for n, _ in grads_a] == [n for n, _ in grads_b], f"{what}: other parameters got gradients"
            for (name, a), (_, b) in zip(grads_a, grads_b):
                same(a, b, f"step {step} grad {name}")
        assert [n for n, _ in w_a] == [n for n, _ in w_b], f"{what}: other parameters"
        for (name, a), (_, b) in zip(w_a, w_b):
            same(a, b, f"step {step} weight {name}")


def same_on_every_rank(record, what):
    for name, mine in record[-1][2]:
        theirs = mine.clone()
        dist.broadcast(theirs, 0)
        assert torch.equal(mine, theirs), f"{what}: replicas differ at {name}"


def did(handle, what, count, close=None):
    """A handle's removal that first asserts ``count(handle) > 0`` (the feature acted)."""

    def remove():
        assert count(handle) > 0, f"{what} did nothing"
        (close or handle.remove)()

    return remove


# -- models and their runs ------------------------------------------------------------------------


def full_model(base, wrapper, rank):
    return copy.deepcopy(base)


def lora_model(base, wrapper, rank):
    """A PEFT LoRA model, B randomised alike on every rank; the base is frozen."""
    from offloadkit.integrations.peft_utils import apply_lora

    torch.manual_seed(1)
    return randomize_lora_b(apply_lora(copy.deepcopy(base), rank=4))


def frozen_layers(base, wrapper, rank):
    """The decoder layers frozen, embeddings, final norm and head trained: a frozen base
    without peft."""
    model = copy.deepcopy(base)
    for _, layer in find_blocks(model):
        layer.requires_grad_(False)
    return model


def plain(make_model, base, wrapper, rank):
    return Run(wrap(make_model(base, wrapper, rank), wrapper))


def engine(base, wrapper, rank):
    """The activation offloading engine around each forward (CPU tensors offloaded)."""
    model = wrap(copy.deepcopy(base), wrapper)
    ctx = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, min_offload_size=0)
    return Run(model, ctx=ctx, handles=[did(ctx, "engine", lambda m: m.stats.offloaded_tensors, ctx.close)])


def ckpt(make_model, base, wrapper, rank, disk=False):
    """Checkpointing with the block inputs offloaded to host buffers, or with ``disk`` to the
    disk tier in a directory of this rank's own."""
    model = make_model(base, wrapper, rank)
    where = {}
    if disk:
        directory = tempfile.mkdtemp(prefix=f"offloadkit-matrix-{wrapper}-{rank}-")
        where = dict(storage="disk", disk=DiskOptions(directory=directory, threads=1))
    handle = apply_activation_checkpointing(
        model, offload_inputs=True, offload_cpu_tensors=True, min_offload_size=0, **where
    )
    offloaded = did(handle, "block-input offload", lambda h: h.offloader.stats.offloaded_tensors)
    return Run(wrap(model, wrapper), handles=[offloaded])


def chunked_loss(base, wrapper, rank):
    from offloadkit.longctx import apply_chunked_loss

    model = copy.deepcopy(base)
    handle = apply_chunked_loss(model, 3)
    return Run(wrap(model, wrapper), handles=[did(handle, "chunked loss", lambda h: h.calls)])


def tiled_mlp(base, wrapper, rank):
    from offloadkit.longctx import apply_tiled_mlp

    model = copy.deepcopy(base)
    handle = apply_tiled_mlp(model, 3)
    return Run(wrap(model, wrapper), handles=[handle.remove])


def adamw(base, wrapper, rank, ours=False, eps=1e-8):
    """torch's AdamW, or BackwardAdamW: its state in host memory, each parameter updated in
    backward from the reduced gradient (under DDP through its communication hook,
    ``reduce_with_ddp``; under FSDP2 from the reduce-scattered shard, nothing to say)."""
    model = wrap(copy.deepcopy(base), wrapper)
    if not ours:
        return Run(model, opt=torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps, foreach=False))
    opt = BackwardAdamW(model.parameters(), lr=1e-2, eps=eps, foreach=False)
    if wrapper == "ddp":
        opt.reduce_with_ddp(model)
    return Run(model, opt=opt, updates_in_backward=True)


def stream(make_model, base, wrapper, rank, after=False, trainable=False):
    """DDP only: the decoder layers' weights streamed (the CPU stand-in for the device), by
    each rank from its own copy. Frozen weights are not DDP's: it reduces only the trainable
    gradients. ``after``: streaming attached to the DDP wrapper. ``trainable``: a full
    fine-tune's weights streamed too, updated in backward by BackwardAdamW."""
    model = make_model(base, wrapper, rank)
    if after:
        model = wrap(model, wrapper)
    streamer = stream_layers_on_cpu(model, trainable=trainable)
    assert streamer.streamed_bytes > 0
    if not after:
        model = wrap(model, wrapper)
    loaded = did(streamer, "layer streaming", lambda s: s.collect_stats().loads)
    if not trainable:
        return Run(model, handles=[loaded])
    opt = BackwardAdamW(model.parameters(), lr=1e-2, foreach=False)
    opt.reduce_with_ddp(model)
    return Run(model, opt=opt, handles=[loaded], updates_in_backward=True)


def lora_stream_ckpt(base, wrapper, rank):
    """DDP only: LoRA with its frozen base streamed, checkpointed with its block inputs offloaded,
    one of them recomputed in backward (replays load the streamed weights first)."""
    model = lora_model(base, wrapper, rank)
    handle = apply_activation_checkpointing(
        model, offload_inputs=True, offload_cpu_tensors=True, min_offload_size=0, recompute_inputs=[1]
    )
    streamer = stream_layers_on_cpu(model)
    handle.register_replay_hook(streamer.make_resident)
    return Run(
        wrap(model, wrapper),
        handles=[did(streamer, "layer streaming", lambda s: s.collect_stats().loads), handle.remove],
    )


ALL = {
    "gradient_checkpointing": True,
    "activation_offloading": "disk",  # on a CPU-only machine: every saved activation to disk
    "disk_threads": 1,
    "min_offload_size": 0,
    "chunked_cross_entropy": True,
    "chunked_cross_entropy_num_chunks": 3,
    "tiled_mlp": True,
    "tiled_mlp_num_shards": 3,
    "optimizer_offloading": True,
}


def together(base, wrapper, rank, after=False):
    """Everything through prepare() (checkpointing, every saved activation on the disk tier in
    this rank's directory, chunked loss, tiled MLP), BackwardAdamW the optimizer; prepare() on
    the model before the wrapper, or with ``after`` on the wrapped model."""
    from offloadkit.compose import prepare

    model = copy.deepcopy(base)
    if after:
        model = wrap(model, wrapper)
    directory = tempfile.mkdtemp(prefix=f"offloadkit-matrix-all-{wrapper}-{rank}-")
    runtime = prepare(model, dict(ALL, disk_dir=directory))
    assert runtime.manager is not None and runtime.checkpointing is not None
    assert runtime.chunked_loss is not None and runtime.tiled_mlp is not None
    if not after:
        model = wrap(model, wrapper)
    opt = BackwardAdamW(model.parameters(), lr=1e-2, eps=ROUND_EPS, foreach=False)
    if wrapper == "ddp":
        opt.reduce_with_ddp(model)

    def close():
        assert runtime.chunked_loss.calls == STEPS
        runtime.close()

    offloaded = did(runtime, "disk tier", lambda r: r.manager.collect_stats().offloaded_tensors, close)
    return Run(model, opt=opt, ctx=runtime.context(), handles=[offloaded], updates_in_backward=True)


P = functools.partial
EXACT = None
# (check, run, reference run, tolerance, wrappers, needs peft)
CHECKS = [
    ("engine", engine, P(plain, full_model), EXACT, ("ddp", "fsdp2"), False),
    ("ckpt-ram", P(ckpt, full_model), P(plain, full_model), EXACT, ("ddp", "fsdp2"), False),
    ("ckpt-disk", P(ckpt, full_model, disk=True), P(plain, full_model), EXACT, ("ddp", "fsdp2"), False),
    ("chunked-loss", chunked_loss, P(plain, full_model), TOL, ("ddp", "fsdp2"), False),
    ("tiled-mlp", tiled_mlp, P(plain, full_model), TOL, ("ddp", "fsdp2"), False),
    ("lora-ckpt", P(ckpt, lora_model), P(plain, lora_model), EXACT, ("ddp", "fsdp2"), True),
    ("backward-adamw", P(adamw, ours=True), adamw, EXACT, ("ddp", "fsdp2"), False),
    ("together", together, P(adamw, eps=ROUND_EPS), TOL, ("ddp", "fsdp2"), False),
    ("together-after", P(together, after=True), P(adamw, eps=ROUND_EPS), TOL, ("ddp", "fsdp2"), False),
    ("stream-frozen", P(stream, frozen_layers), P(plain, frozen_layers), EXACT, ("ddp",), False),
    ("stream-frozen-after", P(stream, frozen_layers, after=True), P(plain, frozen_layers), EXACT, ("ddp",), False),
    ("stream-trainable", P(stream, full_model, trainable=True), adamw, EXACT, ("ddp",), False),
    ("stream-lora-ckpt", lora_stream_ckpt, P(plain, lora_model), EXACT, ("ddp",), True),
]


def refused(rank):
    """Under FSDP2, prepare() refuses layer streaming and recomputed block inputs on both ranks,
    before anything is attached (one line each, naming FSDP2 and the alternative)."""
    from offloadkit.compose import prepare
    from offloadkit.config import ConfigError

    for config, said in (
        ({"layer_offloading": True}, "CPUOffloadPolicy"),
        ({"gradient_checkpointing": True, "recompute_block_inputs": [1]}, "in RAM or on disk"),
    ):
        model = wrap(build_llama("tiny"), "fsdp2")
        try:
            prepare(model, dict(config, chunked_cross_entropy=True))
        except ConfigError as exc:
            assert "FSDP2" in str(exc) and said in str(exc) and "\n" not in str(exc), exc
        else:
            raise AssertionError(f"{config} must be refused under FSDP2")
        assert "forward" not in model.__dict__, "the chunked loss was attached before the refusal"


def main(wrapper, only):
    rank = dist.get_rank()
    base = build_llama("tiny")
    references = {}
    for name, make, make_ref, tol, wrappers, needs_peft in CHECKS:
        check = f"{wrapper}-{name}"
        if wrapper not in wrappers or (only and name not in only):
            continue
        if needs_peft:
            try:
                import peft  # noqa: F401
            except ImportError:
                report(f"SKIP {check} rank={rank} (peft is not installed)")
                continue
        key = repr(make_ref)  # partials of the same function and arguments read alike
        if key not in references:
            references[key] = make_ref(base, wrapper, rank).train(rank)
            same_on_every_rank(references[key], f"{wrapper} reference")
        got = make(base, wrapper, rank).train(rank)
        compare(check, references[key], got, tol)
        same_on_every_rank(got, check)
        report(f"RESULT {check} rank={rank} ok")
    if wrapper == "fsdp2" and (not only or "refused" in only):
        refused(rank)
        report(f"RESULT fsdp2-refused rank={rank} ok")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        main(sys.argv[1], sys.argv[2:])
    finally:
        dist.destroy_process_group()
