"""Drop-and-recompute placement of block inputs (``recompute_inputs``): the dropped inputs are
not kept anywhere and backward recomputes them from the nearest kept one. Losses and
gradients bitwise those of per-block checkpointing; only the kept inputs are saved outside
the blocks; errors are clear."""

import time

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch

pytest.importorskip("transformers")


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), _grads(model)


def _saved_outside_blocks(model, batch):
    """Hidden states autograd keeps at the outermost level during forward: with checkpointing,
    the block inputs (and the final norm's input)."""
    kept = []
    hidden = (*batch["input_ids"].shape, model.config.hidden_size)

    def pack(t):
        if tuple(t.shape) == hidden:
            kept.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    return len(set(kept))


def _train_tiny(tmp_path, offload, max_steps, callbacks=(), **arguments):
    """A 4-layer tiny Llama trained by the Trainer with offloadkit's mixin on byte-level text;
    returns the trainer."""
    transformers = pytest.importorskip("transformers")
    from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    class OffloadTrainer(ActivationOffloadingMixin, transformers.Trainer):
        pass

    torch.manual_seed(0)
    model = build_llama("tiny", vocab_size=259, num_hidden_layers=4, attn_implementation="sdpa")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=max_steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        remove_unused_columns=False,
        **arguments,
    )
    data = TokenBlocks(byte_tokenizer(), load_texts(), 32)
    trainer = OffloadTrainer(
        model=model, args=args, train_dataset=data, offload_config=offload, callbacks=list(callbacks)
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("dropped", [[1], [1, 2], [2, 3], [1, 3]])
def test_losses_and_gradients_bitwise_per_block_checkpointing(dropped):
    shape = {"num_hidden_layers": 4}
    ref, ours = build_llama("tiny", **shape), build_llama("tiny", **shape)
    apply_activation_checkpointing(ref)
    handle = apply_activation_checkpointing(ours, recompute_inputs=dropped)
    for seed in range(2):
        batch = make_batch(ref.config.vocab_size, 2, 32, seed=seed)
        expected, got = _step(ref, batch), _step(ours, batch)
        assert_bitwise_equal(expected[0], got[0], "loss")
        assert_bitwise_equal(expected[1], got[1], "grads")
    handle.remove()


def test_dropped_inputs_are_not_kept():
    shape = {"num_hidden_layers": 4}
    batch = make_batch(256, 2, 64)
    plain = build_llama("tiny", **shape)
    apply_activation_checkpointing(plain)
    dropping = build_llama("tiny", **shape)
    apply_activation_checkpointing(dropping, recompute_inputs=[1, 2, 3])
    # Three distinct block inputs fewer are kept: only block 0's input stands for all four.
    assert _saved_outside_blocks(plain, batch) - _saved_outside_blocks(dropping, batch) == 3


def test_with_bf16_and_offloaded_inputs():
    shape = {"num_hidden_layers": 4}
    ref = build_llama("tiny", dtype=torch.bfloat16, **shape)
    ours = build_llama("tiny", dtype=torch.bfloat16, **shape)
    h_ref = apply_activation_checkpointing(ref, offload_inputs=True, offload_cpu_tensors=True)
    handle = apply_activation_checkpointing(
        ours, offload_inputs=True, offload_cpu_tensors=True, recompute_inputs=[2, 3]
    )
    batch = make_batch(ref.config.vocab_size, 2, 32)
    expected, got = _step(ref, batch), _step(ours, batch)
    assert_bitwise_equal(expected[0], got[0], "loss")
    assert_bitwise_equal(expected[1], got[1], "grads")
    # The dropped inputs never reach the offloader. Block 3's input is not offloaded either
    # way (the last block keeps its input on the device): block 2's is the one fewer sent.
    block_input = 2 * 32 * ref.config.hidden_size * 2
    sent = [h.offloader.collect_stats().offloaded_bytes for h in (h_ref, handle)]
    assert sent[0] - sent[1] == block_input, sent
    handle.remove()


def test_errors_are_clear():
    model = build_llama("tiny", num_hidden_layers=3)
    with pytest.raises(ValueError, match="block 0's input has nothing before it"):
        apply_activation_checkpointing(model, recompute_inputs=[0])
    with pytest.raises(ValueError, match="recompute_inputs=\\[5\\] is invalid"):
        apply_activation_checkpointing(model, recompute_inputs=[5])


def test_a_forward_that_fails_inside_a_region_leaves_the_next_step_exact():
    shape = {"num_hidden_layers": 4}
    ref, ours = build_llama("tiny", **shape), build_llama("tiny", **shape)
    apply_activation_checkpointing(ref)
    apply_activation_checkpointing(ours, recompute_inputs=[2, 3])
    batch = make_batch(ref.config.vocab_size, 2, 32)

    def fail(module, args):
        raise RuntimeError("injected")

    hook = ours.model.layers[2].register_forward_pre_hook(fail)  # the region opened at block 1
    with pytest.raises(RuntimeError, match="injected"):
        ours(**batch)
    hook.remove()
    # Nothing of the abandoned region stays installed on this thread (the reference runs first).
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    expected, got = _step(ref, batch), _step(ours, batch)
    assert_bitwise_equal(expected[0], got[0], "loss")
    assert_bitwise_equal(expected[1], got[1], "grads")


def test_through_the_config_and_the_trainer(tmp_path, monkeypatch):
    """``recompute_block_inputs`` in a config: the Trainer keeps offloadkit's checkpointing
    (its own cannot drop inputs), and the losses and weights are those of plain checkpointing."""
    from offloadkit.config import ConfigError, OffloadConfig

    def train(offload):
        trainer = _train_tiny(tmp_path, offload, 3, learning_rate=1e-3, logging_steps=1, seed=0)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    from offloadkit.checkpointing.apply import CheckpointedBlocks

    replays = []
    original_replay = CheckpointedBlocks._replay
    monkeypatch.setattr(
        CheckpointedBlocks, "_replay", lambda self, *a, **k: (replays.append(1), original_replay(self, *a, **k))[1]
    )
    base = {"gradient_checkpointing": True, "activation_offloading": False}
    ref_losses, ref_weights = train(base)
    assert replays == []
    losses, weights = train({**base, "recompute_block_inputs": [2, 3]})
    assert len(replays) == 3, "one region replayed in each step's backward"
    assert losses == ref_losses and len(losses) == 3
    assert_bitwise_equal(ref_weights, weights, "weights")
    assert OffloadConfig.from_dict({"recompute_block_inputs": [1, 2]}).recompute_block_inputs == (1, 2)
    with pytest.raises(ConfigError, match="recompute_block_inputs=\\(0,\\) is invalid"):
        OffloadConfig.from_dict({"recompute_block_inputs": [0]})


@pytest.mark.parametrize(
    "offload",
    [
        {"block_input_placement": ["ram", "recompute", "ram", "gpu"]},
        {"offload_plan": "auto", "seq_len": 32, "host_budget_bytes": "1GiB"},
    ],
    ids=["placement", "plan"],
)
def test_the_trainer_leaves_placed_and_planned_runs_to_offloadkits_checkpointing(tmp_path, offload):
    """A placement (given, or made by ``offload_plan: auto`` inside prepare()) needs
    offloadkit's checkpointing; the Trainer's own must stay off, or every block would be
    checkpointed twice (recomputed twice in backward)."""
    transformers = pytest.importorskip("transformers")
    from offloadkit.checkpointing.apply import _MARK
    from offloadkit.models.heads import unwrap_model

    seen = []

    class Probe(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            modules = list(unwrap_model(model).modules())
            hf = any(getattr(m, "gradient_checkpointing", False) for m in modules)
            ours = any(_MARK in m.__dict__ for m in modules)
            seen.append((hf, ours))

    config = {"gradient_checkpointing": True, "activation_offloading": False, **offload}
    if "block_input_placement" in offload:
        config["activation_offloading"] = True  # no effect without CUDA; the placement still applies
    trainer = _train_tiny(tmp_path, config, 2, callbacks=[Probe()], gradient_checkpointing=True)
    assert seen == [(False, True), (False, True)]
    assert trainer.offload_report["checkpointing_active"]


def test_a_placement_through_checkpointings_own_offloader(tmp_path):
    """``apply_activation_checkpointing(offload_inputs=True, placement=...)`` with a tiered
    store: each kept input where its place says, the dropped ones nowhere; bitwise."""
    from offloadkit.storage import DiskOptions, HostMemoryBudget

    shape = {"num_hidden_layers": 6, "attn_implementation": "sdpa"}  # no [B, 1, S, S] mask of block size
    ref, ours = build_llama("tiny", **shape), build_llama("tiny", **shape)
    apply_activation_checkpointing(ref)
    placement = ["disk", "recompute", "ram", "disk", "ram", "gpu"]
    handle = apply_activation_checkpointing(
        ours,
        offload_inputs=True,
        offload_cpu_tensors=True,
        storage="tiered",
        budget=HostMemoryBudget(1 << 30, min_free_bytes=0),
        disk=DiskOptions(directory=str(tmp_path)),
        placement=placement,
    )
    assert handle.recompute_inputs == {1}
    batch = make_batch(ref.config.vocab_size, 2, 64)
    expected, got = _step(ref, batch), _step(ours, batch)
    assert_bitwise_equal(expected[0], got[0], "loss")
    assert_bitwise_equal(expected[1], got[1], "grads")
    # Where the block inputs were (their entries live until the graph goes): count them again.
    block = 2 * 64 * ours.config.hidden_size * 4
    ours.zero_grad(set_to_none=True)
    loss = ours(**batch).loss
    blocks = [e for e in handle.offloader._entries if e.nbytes == block]
    wanted = sorted(p == "ram" for p in placement if p in ("ram", "disk"))
    # A block placed on disk is written there by the disk tier's writer thread: it leaves RAM
    # when that write completes (later on a loaded machine).
    deadline = time.monotonic() + 30
    while sorted(e.stored.payload.in_ram for e in blocks) != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(e.stored.payload.in_ram for e in blocks) == wanted
    loss.backward()
    handle.remove()
