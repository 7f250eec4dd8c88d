"""What cannot run under FSDP2 is refused before the first step, in one line naming both things
and the alternative: by prepare() on a sharded model (nothing attached), by the feature's own
apply on a sharded model, and at the first forward where the model was sharded after the feature
was attached. And what FSDP2 replaces is followed: a backward optimizer made before ``fully_shard``
(as the Trainer's FSDP2 route makes it) hooks the sharded parameters Accelerate puts in its
groups. One rank over gloo, in this process."""

import socket
import sys

import pytest
import torch

from offloadkit.compose import prepare
from offloadkit.config import ConfigError
from offloadkit.testing import build_llama, make_batch

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a gloo process group on Linux")

dist = pytest.importorskip("torch.distributed")
fsdp = pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard(model, layers=True):
    if layers:
        for layer in model.model.layers:
            fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return model


def untouched(model):
    """Nothing of offloadkit attached: no forward replaced, no hook left."""
    assert "forward" not in model.__dict__
    for layer in model.model.layers:
        assert "forward" not in layer.__dict__
        assert "forward" not in layer.mlp.__dict__
    return True


STREAMING = "layer_offloading cannot stream weights that FSDP2 shards (model.layers.0 is fully_shard-ed)"
RECOMPUTE = "recompute_block_inputs cannot replay blocks that FSDP2 shards (model.layers.0 is fully_shard-ed"


def test_prepare_refuses_layer_streaming_of_fsdp2_shards_before_attaching_anything(one_rank):
    model = shard(build_llama("tiny"))
    config = {
        "layer_offloading": True,
        "chunked_cross_entropy": True,
        "tiled_mlp": True,
        "gradient_checkpointing": True,
    }
    with pytest.raises(ConfigError) as exc:
        prepare(model, config)
    message = str(exc.value)
    assert message.startswith(STREAMING) and "\n" not in message
    assert "offload_policy=CPUOffloadPolicy()" in message and "DDP" in message
    assert untouched(model)
    # Sharded only at the root, FSDP2 still owns every weight.
    with pytest.raises(ConfigError, match="the model is fully_shard-ed"):
        prepare(shard(build_llama("tiny"), layers=False), {"layer_offloading": True})


@pytest.mark.parametrize(
    "config",
    [
        {"recompute_block_inputs": [1]},
        {"activation_offloading": "disk", "block_input_placement": ["disk", "recompute"]},
    ],
    ids=["recompute_block_inputs", "placement"],
)
def test_prepare_refuses_recomputed_block_inputs_of_layers_fsdp2_shards(one_rank, config):
    model = shard(build_llama("tiny"))
    with pytest.raises(ConfigError) as exc:
        prepare(model, {"gradient_checkpointing": True, "chunked_cross_entropy": True, **config})
    message = str(exc.value)
    assert message.startswith(RECOMPUTE) and "\n" not in message
    assert "in RAM or on disk" in message and "DDP" in message
    assert untouched(model)


def test_what_runs_under_fsdp2_or_ddp_is_not_refused(one_rank):
    """Recomputed inputs with FSDP2 at the root only (its weights stay gathered until backward),
    and layer streaming or recomputed inputs under DDP: accepted (the two-rank matrix runs them)."""
    from torch.nn.parallel import DistributedDataParallel

    batch = make_batch(256, 2, 16)
    runtime = prepare(
        shard(build_llama("tiny"), layers=False), {"gradient_checkpointing": True, "recompute_block_inputs": [1]}
    )
    runtime.model(**batch).loss.backward()
    runtime.close()
    model = DistributedDataParallel(build_llama("tiny"))
    with pytest.warns(UserWarning, match="layer_offloading has no effect without a CUDA GPU"):
        runtime = prepare(
            model, {"layer_offloading": True, "gradient_checkpointing": True, "recompute_block_inputs": [1]}
        )
    model(**batch).loss.backward()
    runtime.close()


def test_a_plan_that_chooses_what_fsdp2_cannot_run_says_so(one_rank, monkeypatch):
    import offloadkit.compose as compose

    class Chosen:
        fits = True
        name = "stub"

        def __init__(self, keys):
            self.keys = keys

        def to_config(self):
            return self.keys

    model = shard(build_llama("tiny"))
    for keys, said in (
        ({"layer_offloading": True}, "layer_offloading (chosen by offload_plan: auto) cannot stream"),
        (
            {"gradient_checkpointing": True, "recompute_block_inputs": (1,)},
            "recompute_block_inputs (offload_plan: auto chose layers [1]; give block_input_placement yourself",
        ),
    ):
        monkeypatch.setattr(compose, "plan_for", lambda *args, keys=keys: Chosen(keys))
        with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            prepare(model, {"offload_plan": "auto", "seq_len": 16})
        assert untouched(model)


def test_layer_streaming_attached_before_fully_shard_is_refused_at_the_first_forward(one_rank):
    from offloadkit.testing.cpu_streaming import stream_layers_on_cpu

    model = build_llama("tiny")
    for p in model.parameters():
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    streamer = stream_layers_on_cpu(model)
    shard(model)  # replaces the weights the streamer holds: streaming them would save nothing
    with pytest.raises(ValueError) as exc:
        model(**make_batch(256, 2, 16))
    assert str(exc.value).startswith(
        "layer_offloading (attached before fully_shard) cannot stream weights that FSDP2 shards (model.layers.0"
    )
    streamer.remove()


def test_recomputed_inputs_of_layers_sharded_later_are_refused_at_the_first_forward(one_rank):
    """Checkpointing applied before fully_shard (as FSDP2 examples do it): the first forward
    names FSDP2; applied after, the apply refuses."""
    from offloadkit.checkpointing import apply_activation_checkpointing

    model = build_llama("tiny")
    handle = apply_activation_checkpointing(model, recompute_inputs=[1])
    shard(model)
    with pytest.raises(RuntimeError) as exc:
        model(**make_batch(256, 2, 16))
    assert str(exc.value).startswith(RECOMPUTE)
    handle.remove()
    with pytest.raises(ValueError, match=RECOMPUTE.replace("(", r"\(")):
        apply_activation_checkpointing(model, recompute_inputs=[1])
    assert torch.isfinite(model(**make_batch(256, 2, 16)).loss)  # usable as it was


def _grads_left(model) -> int:
    return sum(p.grad is not None for p in model.parameters())


def test_a_backward_optimizer_made_before_fully_shard_follows_the_sharded_parameters(one_rank):
    from offloadkit.integrations.optimizer import reduce_for_run
    from offloadkit.optim import BackwardAdamW

    torch.manual_seed(0)
    model = build_llama("tiny")
    opt = BackwardAdamW(model.parameters(), lr=1e-2, foreach=False)
    names = [n for n, _ in model.named_parameters()]
    shard(model)
    # What Accelerate's FSDP2 preparation does: the groups now hold the sharded parameters.
    sharded = dict(model.named_parameters())
    opt.param_groups[0]["params"] = [sharded[n] for n in names]
    batch = make_batch(256, 2, 16)
    model(**batch).loss.backward()
    assert _grads_left(model) == len(names), "the hooks were on the parameters fully_shard replaced"
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # updates from the held gradients, then follows the new parameters
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    assert _grads_left(model) == 0, "updated in backward from the second step on"
    assert not opt.follow_parameters(), "nothing replaced since"

    # The Trainer route follows them at its first training step, with the layers' update groups.
    model = build_llama("tiny")
    opt = BackwardAdamW(model.parameters(), lr=1e-2, foreach=False)
    shard(model)
    sharded = dict(model.named_parameters())
    opt.param_groups[0]["params"] = [sharded[n] for n in names]
    reduce_for_run(opt, model)
    model(**batch).loss.backward()
    assert _grads_left(model) == 0
    layer0 = {id(p) for p in model.model.layers[0].parameters()}
    assert layer0 <= set(opt._copies._group), "the update groups name the sharded parameters"


def test_a_shard_reduced_twice_in_one_backward_is_refused_after_its_first_update(monkeypatch):
    import offloadkit.optim.backward as backward
    from offloadkit.optim import BackwardSGD

    w = torch.nn.Parameter(torch.ones(3))
    opt = BackwardSGD([w], lr=0.5)
    # As FSDP2's reduction calls a hook, twice in one backward for a module that ran twice.
    monkeypatch.setattr(backward, "is_shard", lambda p: True)
    monkeypatch.setattr(backward, "in_fsdp_reduce", lambda: True)
    monkeypatch.setattr(backward, "current_graph_task", lambda: 7)
    w.grad = torch.ones(3)
    opt._on_grad(w)
    assert torch.equal(w.detach(), torch.full((3,), 0.5)) and w.grad is None
    w.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="reduced a \\[3\\] shard's gradient twice in one backward"):
        opt._on_grad(w)
    opt.step()  # a new pass: the next backward's reduction updates again
    w.grad = torch.ones(3)
    opt._on_grad(w)
    assert torch.equal(w.detach(), torch.zeros(3))
