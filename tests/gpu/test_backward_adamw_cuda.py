"""BackwardAdamW on the GPU: bitwise equal to torch.optim.AdamW with the same implementation
(the default multi-tensor kernels, the single-tensor loop, the fused kernel) on a bf16 and an
fp32 Llama, moments in pinned host memory, and a peak that holds
neither the gradients nor the moments."""

import pytest
import torch

from offloadkit.optim import BackwardAdamW
from offloadkit.testing import Fp32MasterAdamW, assert_bitwise_equal, build_llama, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")
DEV = "cuda"


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", [{}, {"foreach": False}, {"fused": True}], ids=["default", "single", "fused"])
def test_updates_bitwise_equal_to_torch_adamw(dtype, kernel):
    ref = build_llama("small", dtype=dtype, device=DEV)
    ours = build_llama("small", dtype=dtype, device=DEV)
    batch = make_batch(2048, 2, 256, device=DEV)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, **kernel)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3, **kernel)
    for step in range(3):
        ref(**batch).loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        ours(**batch).loss.backward()
        assert all(p.grad is None for p in ours.parameters())
        opt.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")
    state = opt.state[next(ours.parameters())]
    assert state["exp_avg"].is_pinned() and state["exp_avg"].dtype == dtype


@pytest.mark.parametrize("kernel", [{}, {"fused": True}], ids=["default", "fused"])
def test_fp32_master_weights_bitwise_equal_to_adamw_over_fp32_copies(kernel):
    ref = build_llama("small", dtype=torch.bfloat16, device=DEV)
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV)
    batch = make_batch(2048, 2, 256, device=DEV)
    opt_ref = Fp32MasterAdamW(ref.parameters(), lr=1e-3, **kernel)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3, master_weights=True, **kernel)
    for step in range(3):
        ref(**batch).loss.backward()
        opt_ref.step()
        ours(**batch).loss.backward()
        opt.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")
    state = opt.state[next(ours.parameters())]
    assert state["master"].is_pinned() and state["master"].dtype == torch.float32


def test_peak_holds_neither_gradients_nor_moments():
    torch.manual_seed(0)
    model = build_llama("small", dtype=torch.float32, device=DEV, num_hidden_layers=8)
    batch = make_batch(2048, 1, 64, device=DEV)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def peak(make_opt):
        opt = make_opt()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        top = torch.cuda.max_memory_allocated()
        if isinstance(opt, BackwardAdamW):
            opt.remove()
        del opt
        torch.cuda.empty_cache()
        return top

    plain = peak(lambda: torch.optim.AdamW(model.parameters(), lr=1e-4))
    # A window of one parameter: the state of at most one parameter ahead and one on its way
    # back is on the GPU besides the one being updated.
    ours = peak(lambda: BackwardAdamW(model.parameters(), lr=1e-4, copy_window_bytes=1))
    # AdamW holds the gradients and two moments (3x the weights) at its step; in backward
    # only a few parameters' gradients and moments are on the GPU at a time.
    assert plain - ours >= 2 * weights, (plain, ours, weights)
    # The default window (1 GiB, more than this model's state) may hold it all in flight.
    windowed = peak(lambda: BackwardAdamW(model.parameters(), lr=1e-4))
    assert windowed <= plain, (plain, windowed)


@pytest.mark.parametrize("chunked_loss", [False, True])
def test_trainer_with_fp32_master_weights_and_offloading_matches_mixed_precision_adamw(tmp_path, chunked_loss):
    """What ``offloadkit train`` runs for a full fine-tune (checkpointing, activation
    offloading, optionally the chunked loss, BackwardAdamW with fp32 master weights) against
    the same run whose optimizer is hand-written mixed-precision AdamW: losses and weights
    bitwise, over steps whose updates build on each other."""
    transformers = pytest.importorskip("transformers")
    from offloadkit.data import BYTE_VOCAB_SIZE, TokenBlocks, byte_tokenizer, load_texts
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    trainer_cls = type("T", (ActivationOffloadingMixin, transformers.Trainer), {})
    common = {"gradient_checkpointing": True, "activation_offloading": True, "chunked_cross_entropy": chunked_loss}

    def run(name, optimizer_offloading):
        torch.manual_seed(0)
        model = build_llama("small", vocab_size=BYTE_VOCAB_SIZE, dtype=torch.bfloat16, device=DEV)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=4,
            max_steps=6,
            learning_rate=1e-3,
            weight_decay=0.0,
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
            remove_unused_columns=False,
            # The reference runs the multi-tensor kernels; the Trainer's default (fused) rounds
            # differently, and BackwardAdamW would follow it.
            optim="adamw_torch",
        )
        extra = {}
        config = dict(common)
        if optimizer_offloading:
            config.update(optimizer_offloading=True, optimizer_precision="fp32_master")
        else:
            extra["optimizers"] = (Fp32MasterAdamW(model.parameters(), lr=1e-3, weight_decay=0.0), None)
        data = TokenBlocks(byte_tokenizer(), load_texts(), 256)
        trainer = trainer_cls(model=model, args=args, train_dataset=data, offload_config=config, **extra)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, _params(model)

    ref_losses, ref_weights = run("ref", optimizer_offloading=False)
    losses, weights = run("ours", optimizer_offloading=True)
    assert len(losses) == 6 and losses == ref_losses, (losses, ref_losses)
    assert_bitwise_equal(ref_weights, weights, "weights after training")


@pytest.mark.parametrize("master", [False, True], ids=["bf16", "fp32_master"])
@pytest.mark.parametrize("window", [1 << 30, 1, "quarter"], ids=["window", "one-at-a-time", "ring-wraps"])
def test_state_copies_delayed_on_both_streams_stay_bitwise(master, window):
    """Every state copy (in on the host->device stream, fetched ahead from the second step
    on; back on the device->host stream) delayed by milliseconds, with compute that does
    not wait for anything it need not: the parameters stay bitwise those of the reference,
    so no update reads state that has not landed and no fetch reads state not yet written
    back. A one-byte window exercises the host waiting for copies back; a window of a quarter
    of the state (the decoder's matrices go through the pass's arena, the embeddings' do
    not) makes the arena wrap, so a fetch reuses bytes whose copy back is still delayed."""
    from offloadkit.testing import slow_copies

    ref = build_llama("small", dtype=torch.bfloat16, device=DEV)
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV)
    batch = make_batch(2048, 2, 128, device=DEV)
    opt_ref = Fp32MasterAdamW(ref.parameters(), lr=1e-3) if master else torch.optim.AdamW(ref.parameters(), lr=1e-3)
    if window == "quarter":
        state_bytes = sum(p.numel() * (4 * 3 if master else 2 * 2) for p in ours.parameters())
        window = state_bytes // 4
    opt = BackwardAdamW(ours.parameters(), lr=1e-3, master_weights=master, copy_window_bytes=window)
    with slow_copies(2_000_000):
        for step in range(4):
            ref(**batch).loss.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            ours(**batch).loss.backward()
            opt.step()
            assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")
    assert len(opt._copies._order) == len(list(ours.parameters()))  # the order was learned
    arena = opt._copies.arena_stats
    if window > 1:
        assert arena.carved > 0, arena  # steps 2-4 took their state from the pass's arena
    if 1 < window < (1 << 30):
        assert arena.wrapped > 0, arena
    saved = opt.state_dict()  # waits for the copies back: the host state is final
    key = "master" if master else "exp_avg"
    first = next(ours.parameters())
    assert saved["state"][0][key].data_ptr() == opt.state[first][key].data_ptr()


def test_compact_state_with_delayed_copies_matches_the_undelayed_run_bitwise():
    """The compact option on the GPU (bf16 moments in pinned memory, the update in fp32
    chunks, stochastic rounding from a seeded CUDA generator): with every state copy delayed
    by milliseconds the run is bitwise the undelayed one: no update reads state that has not
    landed, and the rounding's random stream is the same."""
    import contextlib

    from offloadkit.testing import slow_copies

    runs = []
    for delayed in (False, True):
        model = build_llama("small", dtype=torch.bfloat16, device=DEV)
        batch = make_batch(2048, 2, 128, device=DEV)
        opt = BackwardAdamW(model.parameters(), lr=1e-3, stochastic_rounding=True, seed=5, chunk_elements=1 << 16)
        with slow_copies(2_000_000) if delayed else contextlib.nullcontext():
            losses = []
            for _ in range(4):
                loss = model(**batch).loss
                loss.backward()
                opt.step()
                losses.append(loss.item())
        state = opt.state[next(model.parameters())]
        assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg"].is_pinned()
        runs.append((losses, _params(model)))
    assert runs[0][0] == runs[1][0] and runs[0][0][-1] < runs[0][0][0]
    assert_bitwise_equal(runs[0][1], runs[1][1], "compact, delayed copies")


def test_compact_state_resumes_bitwise_from_a_checkpoint_loaded_onto_the_gpu():
    """A compact run on the GPU saved after 2 steps and loaded with every tensor mapped to the
    GPU (as the Trainer loads under several processes), CUDA generator state included: the 2
    steps after it are bitwise those of the uninterrupted run."""

    def run(resume: bool):
        model = build_llama("small", dtype=torch.bfloat16, device=DEV)
        batch = make_batch(2048, 2, 128, device=DEV)
        opt = BackwardAdamW(model.parameters(), lr=1e-3, stochastic_rounding=True, seed=7)
        for step in range(4):
            if resume and step == 2:
                saved = opt.state_dict()
                on_gpu = torch.utils._pytree.tree_map(lambda x: x.to(DEV) if isinstance(x, torch.Tensor) else x, saved)
                opt.remove()
                opt = BackwardAdamW(model.parameters(), lr=1e-3, stochastic_rounding=True, seed=0)
                opt.load_state_dict(on_gpu)
            model(**batch).loss.backward()
            opt.step()
        return _params(model)

    assert_bitwise_equal(run(False), run(True), "compact, resumed from a GPU-mapped checkpoint")
