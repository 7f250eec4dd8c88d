"""A step at the planner's longest sequence for a smaller GPU, run on a bigger one with that
GPU's budget enforced (``gpu_budget_bytes``: the caching allocator's per-process fraction).

The plan is made for the full-depth model under ``--gpu-gib`` / ``--host-gib`` / ``--disk-gib``;
the step runs at ``--layers`` (the GPU peak of a LoRA step with block inputs offloaded and
weights streamed does not depend on depth), with the plan's features applied as config.

    PYTHONPATH=$PWD python3 benchmarks/gpu_budget_probe.py --gpu-gib 16 --layers 2 --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import time

GiB = float(1 << 30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--gpu-gib", type=float, required=True)
    ap.add_argument("--host-gib", type=float, default=108.0)
    ap.add_argument("--disk-gib", type=float, default=55.0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the planner's longest")
    ap.add_argument("--out", default="gpu-budget-results")
    args = ap.parse_args()

    import torch

    from offloadkit.compose import prepare
    from offloadkit.integrations.peft_utils import apply_lora
    from offloadkit.models.zoo import build_llama
    from offloadkit.planning import Budgets, longest_sequence, plan

    budgets = Budgets(int(args.gpu_gib * GiB), int(args.host_gib * GiB), int(args.disk_gib * GiB))
    cap = longest_sequence(args.shape, lora_rank=args.lora_rank, budgets=budgets)
    seq = args.seq_len or cap.longest
    full = plan(args.shape, seq, lora_rank=args.lora_rank, budgets=budgets)
    config = {k: v for k, v in full.to_config().items() if v is not None}
    # At reduced depth every block input fits in RAM: the GPU side is what is measured.
    config.update(gpu_budget_bytes=int(args.gpu_gib * GiB))
    if config.get("activation_offloading") == "disk":
        config.update(activation_offloading=True, disk_tiering=False)
        config.pop("host_budget_bytes", None)
    config.pop("gpu_block_inputs", None)
    if "block_input_placement" in config:
        # The plan places the full depth's inputs; the probe's blocks take the places of the
        # last ones (those on the GPU among them), the rest in RAM.
        tail = list(config["block_input_placement"])[-args.layers :]
        config["block_input_placement"] = tuple(p if p == "gpu" else "ram" for p in tail)

    model = build_llama(
        args.shape,
        dtype=torch.bfloat16,
        device="cuda",
        attn_implementation="sdpa",
        num_hidden_layers=args.layers,
        max_position_embeddings=max(seq, 131072),
    )
    model.config.use_cache = False
    model = apply_lora(model, rank=args.lora_rank).train()
    runtime = prepare(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda")
    row = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "layers_run": args.layers,
        "seq_len": seq,
        "budgets_gib": {"gpu": args.gpu_gib, "host": args.host_gib, "disk": args.disk_gib},
        "longest": cap.longest,
        "physical": cap.physical,
        "ratio": cap.ratio,
        "plan": full.name,
        "config": runtime.config.to_dict(),
        "predicted_peak_gib": full.memory.gpu_peak / GiB,
        "predicted_reserved_gib": full.memory.gpu_reserved / GiB,
    }
    torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with runtime.context():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        row.update(status="ok", loss=float(loss), step_s=times)
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc).splitlines()[0])
    row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
    row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    row["within_budget"] = row["peak_reserved_gib"] <= args.gpu_gib
    runtime.close()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu-budget-{args.gpu_gib:g}gib.json")
    with open(path, "w") as f:
        json.dump(row, f, indent=1, default=str)
    print(json.dumps({k: row[k] for k in row if k != "config"}, default=str))


if __name__ == "__main__":
    main()
