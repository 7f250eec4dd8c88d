"""Where a training step's peak GPU memory goes: replays PyTorch's allocator history
(``torch.cuda.memory._record_memory_history``) over one step, finds the moment of the highest
allocated total, and prints the blocks alive then, grouped by the Python line that allocated
them (the innermost frame outside torch).

    python benchmarks/explain_peak.py --cell loops-nonreentrant [--accumulation 4] [--mixin]

Used to explain a peak that differs between two runs (with and without offloadkit);
``--profile`` prints the step's host operators instead (where a slower step spends its time).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def live_at_peak(snapshot: dict) -> tuple[int, list[dict]]:
    """(peak bytes, the allocation events alive at the peak) from a snapshot's trace."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for trace in snapshot["device_traces"]:
        for event in trace:
            if event["action"] == "alloc":
                live[event["addr"]] = event
                total += event["size"]
                if total > peak:
                    peak, at_peak = total, list(live.values())
            elif event["action"] == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])["size"]
    return peak, at_peak


def _where(event: dict) -> str:
    for frame in event.get("frames", []):
        name = frame.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name:
            return f"{os.path.basename(name)}:{frame.get('line')} {frame.get('name')}"
    return "(inside torch)"


def summary(snapshot: dict, top: int = 20) -> str:
    peak, blocks = live_at_peak(snapshot)
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for event in blocks:
        groups[_where(event)].append(event["size"])
    lines = [f"peak of the recorded span: {peak / 2**20:.1f} MiB in {len(blocks)} blocks"]
    for where, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(sizes) / 2**20:9.1f} MiB  {len(sizes):5d} blocks  {where}")
    return "\n".join(lines)


def recorded_step(step, top: int = 30, max_entries: int = 500_000):
    """Run ``step()`` once with the allocator's history recorded: (its result, the lines of
    :func:`summary`, or ``None`` and the error).

    The step's checkpoints recompute each layer to its end: with torch 2.11 recording, a
    recompute stopped early, once it had what backward needs, lost its stop signal inside the
    tiled MLP (``SystemError: ... returned NULL without setting an exception``, with Python
    frames only as with C++ ones; PyTorch's issue 179536, a regression from 2.10). Running the
    rest of a layer adds its output-sized temporaries to the recompute, which ends before the
    layer's backward starts."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        with set_checkpoint_early_stop(False):
            result = step()
        torch.cuda.synchronize()
        return result, summary(torch.cuda.memory._snapshot(), top=top).splitlines()
    except Exception as err:  # the breakdown is a diagnosis: the timed steps before it stand
        return None, [f"no breakdown: {type(err).__name__}: {err}"[:300]]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def main():
    import transformers

    from benchmarks.compat_trainers import _agreement, _args_common, _token_rows, lora_model
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--mixin", action="store_true")
    parser.add_argument("--reentrant", action="store_true")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--profile", action="store_true", help="also print the host operators of step 2")
    args = parser.parse_args()

    class Record(transformers.TrainerCallback):
        text = ""

        prof = None

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == 1:
                torch.cuda.synchronize()
                if args.profile:
                    self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    self.prof.__enter__()
                else:
                    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")

        def on_step_end(self, a, state, control, **kw):
            if state.global_step == 2:
                torch.cuda.synchronize()
                if self.prof is not None:
                    self.prof.__exit__(None, None, None)
                    self.text = self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
                else:
                    self.text = summary(torch.cuda.memory._snapshot())
                    torch.cuda.memory._record_memory_history(enabled=None)

    cls = type("Mixed", (ActivationOffloadingMixin, transformers.Trainer), {}) if args.mixin else transformers.Trainer
    extra = {"offload_config": {"gradient_checkpointing": True, "activation_offloading": True}} if args.mixin else {}
    record = Record()
    with tempfile.TemporaryDirectory() as folder:
        common = _args_common(folder, "probe", True, remove_unused_columns=False)
        common.update(
            max_steps=3,
            gradient_accumulation_steps=args.accumulation,
            gradient_checkpointing_kwargs={"use_reentrant": args.reentrant},
        )
        trainer = cls(
            model=lora_model(args.seq_len),
            args=transformers.TrainingArguments(**common),
            train_dataset=_token_rows(args.seq_len, 4 * args.accumulation * 2),
            compute_metrics=_agreement,
            callbacks=[record],
            **extra,
        )
        trainer.train()
    report = getattr(trainer, "offload_report", None) or {}
    print(f"== mixin={args.mixin} accumulation={args.accumulation} reentrant={args.reentrant}")
    print(record.text)
    stats = report.get("activations") or {}
    keys = ("offloaded_bytes", "kept_bytes", "kept_by_reason", "restored_bytes", "prefetch_hits", "prefetch_misses")
    print({k: stats.get(k) for k in (*keys, "wait_seconds_forward", "wait_seconds_backward", "host_wait_seconds")})


if __name__ == "__main__":
    main()
