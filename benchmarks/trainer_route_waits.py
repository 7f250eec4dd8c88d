"""Where the Trainer route's GPU waits for activations when BackwardAdamW's state copies share
the link: the route of ``tests/gpu/test_full_ft_memory_cuda.py`` (4 layers, 2048 wide, 8,192
tokens, optimizer state in host memory, updates in backward), with the copies arranged in
several ways. Each variant runs in a process of its own; per variant: the step time and the GPU's
waits for activations (forward and backward) per step, medians of the steps after the first.

Variants (diagnostic rearrangements applied from here, not options of the library):
``as_is``; ``no_state`` (torch's AdamW, state on the GPU: the waits without state copies);
``state_on_h2d`` (state copies in the activations' host->device queue, as before the bulk
queue); ``state_chunks`` (every state copy split into 16 MiB pieces); ``priorities`` (the
activations' queue at high stream priority, the bulk one at low); ``horizon4``
(``activation_loading_horizon: 4``); ``loads_off_compute`` (block inputs come back into memory of
the host->device stream's own pool, so their copies need not wait for the compute stream).

    python benchmarks/trainer_route_waits.py --out DIR [--variants as_is,no_state,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("as_is", "no_state", "state_on_h2d", "state_chunks", "priorities", "horizon4", "loads_off_compute")


def _rearrange(variant: str) -> None:
    import torch

    from offloadkit.optim import state_copies
    from offloadkit.transfer import streams

    if variant == "state_on_h2d":
        original = state_copies.copy_stream
        state_copies.copy_stream = lambda device, d: original(device, "h2d" if d == "h2d_bulk" else d)
    elif variant == "state_chunks":
        original_copy = state_copies.queue_copy
        piece = 16 << 20

        def chunked(dst, src, *, stream, block, after):
            d, s = dst.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8)
            done = None
            for start in range(0, d.numel(), piece):
                done = original_copy(
                    d[start : start + piece], s[start : start + piece], stream=stream, block=block, after=after
                )
                after = None
            return done

        state_copies.queue_copy = chunked
    elif variant == "loads_off_compute":
        from offloadkit.storage.base import Loaded
        from offloadkit.storage.host import HostTier
        from offloadkit.transfer import queue_copy

        def load(self, stored):
            h2d = streams.copy_stream(stored.device, "h2d")
            with torch.cuda.stream(h2d):
                dst = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
            ready = queue_copy(dst, stored.payload.view(stored.nbytes), stream=h2d, block=stored.payload, after=None)
            return Loaded(dst, ready=ready, alloc_stream=h2d)

        HostTier.load = load
    elif variant == "priorities":
        index = torch.cuda.current_device()
        low, high = torch.cuda.Stream.priority_range()  # (lowest, highest) numerically (0, -N)
        streams._streams[(index, "h2d")] = torch.cuda.Stream(device=index, priority=high)
        streams._streams[(index, "h2d_bulk")] = torch.cuda.Stream(device=index, priority=low)


def run_one(variant: str, steps: int) -> dict:
    import torch

    from offloadkit.testing import build_llama
    from offloadkit.testing.trainer_runs import ROUTE_SHAPE, train_timed

    _rearrange(variant)
    model = build_llama(ROUTE_SHAPE, dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    config = {"gradient_checkpointing": True, "optimizer_offloading": variant != "no_state"}
    if variant == "horizon4":
        config["activation_loading_horizon"] = 4
    records = train_timed(model, config, output_dir="/tmp/trainer_route_waits", steps=steps, seq_len=8192)
    later = records[1:]  # the first step builds caches and learns the orders
    times = [r.seconds for r in later]
    waits = [(r.stats.wait_seconds_forward, r.stats.wait_seconds_backward) for r in later]
    return {
        "variant": variant,
        "step_s": statistics.median(times),
        "wait_forward_ms": 1000 * statistics.median(w[0] for w in waits),
        "wait_backward_ms": 1000 * statistics.median(w[1] for w in waits),
        "max_wait_ms": 1000 * max(sum(w) for w in waits),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--one", default=None, help="run one variant in this process")
    args = ap.parse_args()
    if args.one:
        print("RECORD " + json.dumps(run_one(args.one, args.steps)), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    records = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--out", args.out, "--steps", str(args.steps), "--one", variant]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RECORD ")]
        record = json.loads(lines[-1][7:]) if lines else {"variant": variant, "error": proc.stderr[-600:]}
        records.append(record)
        print(json.dumps(record), flush=True)
    with open(os.path.join(args.out, "trainer-route-waits.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
