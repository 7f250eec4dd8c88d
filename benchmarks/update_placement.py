"""Where should a full fine-tune's AdamW update run when its state lives in host memory: on the
CPU, next to the state (gradients go down the link, weights come back), or on the GPU, with the
state streamed in and out (what BackwardAdamW does)?

For one decoder layer of the given shape this measures, on this machine:

* ``cpu``: PyTorch's AdamW on the CPU over the layer's host state (its fused CPU kernel, and the
  multi-tensor loop), plus the link time of the gradient down and the updated weight up;
* ``gpu``: the state's copies host->device and back on the copy streams plus the update
  kernel on the GPU (the copies overlap backward in a real step; the sum is the worst case).

Each is timed per precision (pure bf16: bf16 weights and moments; fp32 master: fp32 master
weights and moments) and scaled to the whole model. Writes ``update-placement.json`` and ``.md``
under ``--out``.

    python benchmarks/update_placement.py --out DIR --shape llama-3-8b
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.optim.adamw import adamw

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offloadkit.planning.shape import resolve_shape  # noqa: E402

GiB = 2**30


def _median(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _layer_tensors(shape, dtype, device):
    return [(torch.randn(a, b, device=device) * 0.02).to(dtype) for a, b in shape.linears]


def measure(shape, precision: str, repeat: int) -> dict:
    master = precision == "fp32_master"
    state_dtype = torch.float32 if master else torch.bfloat16
    params = sum(a * b for a, b in shape.linears)
    # CPU: the state and (master) weights on the host; the bf16 gradient comes down, the
    # bf16 weight goes up.
    w_host = _layer_tensors(shape, state_dtype, "cpu")
    m_host = [torch.zeros_like(t) for t in w_host]
    v_host = [torch.zeros_like(t) for t in w_host]
    g_host = [torch.empty(t.shape, dtype=torch.bfloat16, pin_memory=True) for t in w_host]
    g_gpu = [torch.randn(t.shape, dtype=torch.bfloat16, device="cuda") * 1e-3 for t in w_host]
    out_host = [torch.empty(t.shape, dtype=torch.bfloat16, pin_memory=True) for t in w_host]
    out_gpu = [torch.empty(t.shape, dtype=torch.bfloat16, device="cuda") for t in w_host]
    step = [torch.tensor(1.0) for _ in w_host]
    grads32 = [torch.empty(t.shape, dtype=state_dtype) for t in w_host]

    def cpu_update(fused):
        def run():
            for g, g32 in zip(g_host, grads32):
                g32.copy_(g)
            adamw(
                w_host, grads32, m_host, v_host, [], step, foreach=not fused, fused=fused, capturable=False,
                differentiable=False, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-5, weight_decay=0.0, eps=1e-8,
                maximize=False, has_complex=False,
            )  # fmt: skip

        return run

    def link_grads_down_weights_up():
        for g_d, g_h in zip(g_gpu, g_host):
            g_h.copy_(g_d, non_blocking=True)
        for o_h, o_d in zip(out_host, out_gpu):
            o_d.copy_(o_h, non_blocking=True)

    rows = {}
    for name, fused in (("cpu fused", True), ("cpu foreach", False)):
        try:
            rows[name] = _median(cpu_update(fused), repeat)
        except RuntimeError as exc:  # a build without the fused CPU kernel
            rows[name] = None
            print(f"{name}: {exc}")
    rows["link: gradient down, weight up"] = _median(link_grads_down_weights_up, repeat)

    # GPU: the state (moments, master weights) in and out, and the update kernel.
    keys = 3 if master else 2
    state_host = [torch.empty(t.shape, dtype=state_dtype, pin_memory=True) for t in w_host for _ in range(keys)]
    state_gpu = [torch.empty(t.shape, dtype=state_dtype, device="cuda") for t in state_host]
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()

    def state_in_and_out():
        with torch.cuda.stream(h2d):
            for d, h in zip(state_gpu, state_host):
                d.copy_(h, non_blocking=True)
        with torch.cuda.stream(d2h):
            for d, h in zip(state_gpu, state_host):
                h.copy_(d, non_blocking=True)

    w_gpu = [t.to("cuda") for t in w_host]
    m_gpu = [torch.zeros_like(t) for t in w_gpu]
    v_gpu = [torch.zeros_like(t) for t in w_gpu]
    gg = [g.to(state_dtype) for g in g_gpu]
    step_gpu = [torch.tensor(1.0) for _ in w_gpu]

    def gpu_update():
        adamw(
            w_gpu, gg, m_gpu, v_gpu, [], step_gpu, foreach=True, capturable=False, differentiable=False,
            fused=False, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-5, weight_decay=0.0, eps=1e-8,
            maximize=False, has_complex=False,
        )  # fmt: skip

    rows["gpu: state in and out (both directions at once)"] = _median(state_in_and_out, repeat)
    rows["gpu: update kernel"] = _median(gpu_update, repeat)
    cpu_best = min(v for k, v in rows.items() if k.startswith("cpu ") and v is not None)
    cpu_total = cpu_best + rows["link: gradient down, weight up"]
    gpu_total = rows["gpu: state in and out (both directions at once)"] + rows["gpu: update kernel"]
    scale = shape.params / params
    return {
        "precision": precision,
        "layer_params": params,
        "seconds_per_layer": rows,
        "cpu_seconds_per_step": cpu_total * scale,
        "gpu_seconds_per_step": gpu_total * scale,
        "faster": "gpu" if gpu_total < cpu_total else "cpu",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("update_placement.py compares the CPU with a GPU: it needs one")
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = resolve_shape(args.shape)
    records = [measure(shape, p, args.repeat) for p in ("params", "fp32_master")]
    os.makedirs(args.out, exist_ok=True)
    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    with open(os.path.join(args.out, "update-placement.json"), "w") as f:
        json.dump({"env": env, "shape": args.shape, "records": records}, f, indent=1)
    lines = [
        f"# Where the AdamW update runs: {args.shape}, one decoder layer timed, scaled to the model",
        "",
        f"{env['device']}, torch {env['torch']}, {env['cpu_threads']} CPU threads of {env['cpus']}. "
        f"Command: `python benchmarks/update_placement.py --shape {args.shape}`.",
        "",
        "| precision | part | seconds per layer |",
        "|---|---|---|",
    ]
    for r in records:
        for part, sec in r["seconds_per_layer"].items():
            lines.append(f"| {r['precision']} | {part} | {'n/a' if sec is None else f'{sec:.4f}'} |")
    lines += [
        "",
        "| precision | CPU update + link, s/step | GPU update + state copies, s/step | faster |",
        "|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['precision']} | {r['cpu_seconds_per_step']:.2f} | {r['gpu_seconds_per_step']:.2f} | {r['faster']} |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "update-placement.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
