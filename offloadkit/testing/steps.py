"""Training-loop helpers shared by the test suites: LoRA with non-zero updates, a step on a
side stream, and a loop that records memory after every step."""

from __future__ import annotations

import contextlib

import psutil
import torch

__all__ = [
    "BackwardFailedError",
    "failed_backward",
    "randomize_lora_b",
    "step_on_side_stream",
    "memory_after_each_step",
    "lora_llama",
]


def randomize_lora_b(model: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    """LoRA's B matrices start at zero, which makes most adapter gradients trivially zero;
    give them small random values so parity tests compare real numbers."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    return model


# Two decoder layers of a 1B-class Llama: wide enough that the GPU's kernels behave as at
# scale (the GPU tests' fused-path and layer-time comparisons), small enough for a test.
GPU_LAYER_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)


def lora_llama(shape: str = "small", rank: int = 4) -> torch.nn.Module:
    """A zoo Llama with LoRA adapters on every linear layer (no dropout, B randomised), in
    training mode: the frozen base streams, the adapters train. Needs peft."""
    import peft

    from offloadkit.models.zoo import build_llama

    config = peft.LoraConfig(r=rank, target_modules="all-linear", lora_dropout=0.0)
    model = randomize_lora_b(peft.get_peft_model(build_llama(shape), config))
    model.train()
    return model


def step_on_side_stream(fn, *args, **kwargs):
    """Run ``fn`` with a fresh non-default CUDA stream current (after the default stream's
    work), synchronize, and return its result."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return out


def memory_after_each_step(model, batch: dict, steps: int, ctx=None, check=None) -> tuple[list, list]:
    """Train ``steps`` SGD steps; returns (device bytes allocated, host RSS) after each.

    ``check()`` runs after every step (e.g. asserting that nothing is left behind).
    """
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    proc = psutil.Process()
    allocated, rss = [], []
    cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
    for _ in range(steps):
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        if cuda:
            torch.cuda.synchronize()
        if check is not None:
            check()
        allocated.append(torch.cuda.memory_allocated() if cuda else 0)
        rss.append(proc.memory_info().rss)
    return allocated, rss


class BackwardFailedError(Exception):
    """Raised inside a backward pass by :func:`failed_backward`."""


def failed_backward(model, block: torch.nn.Module, batch: dict):
    """Run ``model`` on ``batch`` and a backward that raises :class:`BackwardFailedError` when it
    reaches ``block``'s output (the blocks after it have run their backward).

    Returns:
        The forward's output, whose graph is still alive (drop it to release the graph).
    """

    def fail_in_backward(module, args, output):
        t = output[0] if isinstance(output, tuple) else output
        t.register_hook(lambda grad: (_ for _ in ()).throw(BackwardFailedError()))

    handle = block.register_forward_hook(fail_in_backward)
    try:
        out = model(**batch)
    finally:
        handle.remove()
    try:
        out.loss.backward()
    except BackwardFailedError:
        return out
    raise AssertionError("the backward did not reach the failing block")
