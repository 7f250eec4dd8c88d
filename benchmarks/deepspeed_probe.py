"""DeepSpeed ZeRO-2 and ZeRO-3 through the Hugging Face Trainer on one GPU, with and
without offloadkit's mixin (checkpointing with checkpoint-input offload): losses over the
same steps, peak GPU memory, the median step time, and any error, for the compatibility matrix.
Eager attention keeps every kernel deterministic, so the losses can be compared bit for bit.

    python benchmarks/deepspeed_probe.py --out DIR

Writes ``deepspeed.json`` under ``--out``; each run is one record. Each run is a process of
its own: transformers remembers a ZeRO-3 config process-wide and then builds every later
model partitioned (``deepspeed.zero.Init``), with other initial weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _profile_step(step: int, path: str):
    """A callback that profiles the optimizer step ``step`` and writes the operators that took
    the most host and device time to ``path``."""
    import transformers

    class ProfileStep(transformers.TrainerCallback):
        prof = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step - 1:
                self.prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.prof is not None:
                torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                table = self.prof.key_averages()
                with open(path, "w") as f:
                    f.write(table.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
                    f.write(table.table(sort_by="self_cuda_time_total", row_limit=25) + "\n")
                self.prof = None

    return ProfileStep()


def _run(stage: int, offload: bool, out: str, profile: bool = False) -> dict:
    import transformers

    from benchmarks.compat_trainers import step_clock
    from offloadkit.integrations.trainer import ActivationOffloadingMixin
    from offloadkit.testing.families import build_family

    torch.manual_seed(0)
    model = build_family("llama", size="bench", dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(3, 31000, (12, 4096), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "labels": r.clone()} for r in ids]
    ds_config = {
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, f"ds{stage}-{offload}"),
        per_device_train_batch_size=1,
        max_steps=12,
        learning_rate=1e-4,
        bf16=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        remove_unused_columns=False,
        lr_scheduler_type="constant",
        deepspeed=ds_config,
        gradient_checkpointing=not offload,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )

    class Mixed(ActivationOffloadingMixin, transformers.Trainer):
        pass

    cls = Mixed if offload else transformers.Trainer
    kwargs = {"offload_config": {"gradient_checkpointing": True, "activation_offloading": True}} if offload else {}
    clock = step_clock()  # each step's time and peak
    callbacks = [clock] + ([_profile_step(4, os.path.join(out, f"profile-ds{stage}-{offload}.txt"))] if profile else [])
    trainer = cls(model=model, args=args, train_dataset=rows, callbacks=callbacks, **kwargs)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    report = getattr(trainer, "offload_report", None) or {}
    return {
        "zero_stage": stage,
        "offloadkit": offload,
        "losses": losses,
        **clock.summary(),
        "offloaded_bytes": (report.get("activations") or {}).get("offloaded_bytes"),
        "notes": report.get("notes", []),
    }


def main():
    import subprocess

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--one", nargs=2, type=int, metavar=("STAGE", "OFFLOAD"), help="run one case here")
    parser.add_argument("--profile", action="store_true", help="write an operator profile of step 4 per case")
    args = parser.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    if args.one:
        stage, offload = args.one
        try:
            record = _run(stage, bool(offload), args.out, args.profile)
        except Exception as exc:  # noqa: BLE001 - the error is the result
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            record = {"zero_stage": stage, "offloadkit": bool(offload), "error": " ".join(last.split())[:400]}
        print("RECORD " + json.dumps(record), flush=True)
        return
    records = []
    for stage in (2, 3):
        for offload in (0, 1):
            proc = subprocess.run(
                [sys.executable, __file__, "--out", args.out, "--one", str(stage), str(offload)]
                + (["--profile"] if args.profile else []),
                capture_output=True,
                text=True,
            )
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RECORD ")]
            record = (
                json.loads(lines[-1][7:])
                if lines
                else {
                    "zero_stage": stage,
                    "offloadkit": bool(offload),
                    "error": (proc.stderr.strip().splitlines() or [""])[-1],
                }
            )
            print(json.dumps(record), flush=True)
            records.append(record)
    with open(os.path.join(args.out, "deepspeed.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": records}, f, indent=1)


if __name__ == "__main__":
    main()
