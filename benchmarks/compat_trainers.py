"""Compatibility cells that run through a trainer, as users run them: TRL's ``SFTTrainer`` and
``DPOTrainer`` (from the ``trl`` package), and the Hugging Face ``Trainer``'s loops (gradient
accumulation with evaluation and ``compute_metrics`` inside ``train()``, reentrant
checkpointing, saving and resuming, ``generate()`` afterwards).

Each cell trains the same LoRA model on the same real text without and with offloadkit's mixin
and compares what the trainer logs, step by step (loss, gradient norm, evaluation loss and
metric), bit for bit, then the trained adapter weights. Eager attention keeps every kernel
deterministic, so equality can be asked for. Peak: the highest GPU memory allocated within a
step after the first (weights, gradients and optimizer state included). Time: the median optimizer step
after the first, synchronized; evaluation between steps is in neither.

    python benchmarks/compat_trainers.py --out DIR [--cells sft,dpo,loops] [--seq-len 2048]

Writes ``compat-trainers.json`` and ``compat-trainers.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.compat import _clean, _sync, _why  # noqa: E402 - one copy of the helpers
from offloadkit.data import BYTE_VOCAB_SIZE, byte_tokenizer, load_texts  # noqa: E402
from offloadkit.integrations.trainer import ActivationOffloadingMixin  # noqa: E402
from offloadkit.models.zoo import build_llama  # noqa: E402

CUDA = torch.cuda.is_available()
GIB = 2**30
STEPS = 10
# Offload every saved tensor; checkpoint-input offload (checkpointing on) is the other mode.
MODES = {
    "offload all": ({"activation_offloading": True}, False),
    "checkpoint-input offload": ({"gradient_checkpointing": True, "activation_offloading": True}, True),
}


def step_clock():
    """A ``TrainerCallback`` that times each optimizer step (synchronized) and records each
    step's peak GPU memory allocated (evaluation between steps excluded), counted from what
    was allocated when the callback was made (before the model is built)."""
    import transformers

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.peaks: list[int] = []
            self._start = 0.0
            # Whatever an earlier run in this process left allocated is not this run's.
            _clean()
            self.base = torch.cuda.memory_allocated() if CUDA else 0

        def on_step_begin(self, args, state, control, **kwargs):
            _sync()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            self.times.append(time.perf_counter() - self._start)
            self.peaks.append(torch.cuda.max_memory_allocated() - self.base if CUDA else 0)

        def summary(self) -> dict:
            """The median step and the highest step peak, both after the first step (which
            builds caches and attaches hooks)."""
            times, peaks = self.times[1:] or self.times, self.peaks[1:] or self.peaks
            return {
                "peak_gib": max(peaks) / GIB,
                "step_s": statistics.median(times),
                "steps_s": [round(t, 4) for t in self.times],
                "peaks_gib": [round(p / GIB, 3) for p in self.peaks],
            }

    return StepClock()


def _shape(seq_len: int) -> dict:
    if CUDA:
        return dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
            vocab_size=BYTE_VOCAB_SIZE,
        )
    return dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=BYTE_VOCAB_SIZE,
    )


def lora_model(seq_len: int, **lora):
    import peft

    base = build_llama(_shape(seq_len), attn_implementation="eager", max_position_embeddings=2 * seq_len)
    base = base.to("cuda" if CUDA else "cpu", torch.bfloat16 if CUDA else torch.float32)
    config = peft.LoraConfig(r=16, target_modules="all-linear", init_lora_weights=False, **lora)
    return peft.get_peft_model(base, config)


def _args_common(folder: str, name: str, ckpt: bool, **extra) -> dict:
    return {
        "output_dir": os.path.join(folder, name),
        "per_device_train_batch_size": 2,
        "max_steps": STEPS,
        "report_to": [],
        "disable_tqdm": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": 0,
        "bf16": CUDA,
        "use_cpu": not CUDA,
        "gradient_checkpointing": ckpt,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "lr_scheduler_type": "constant",
        "learning_rate": 1e-4,
        **extra,
    }


def _logged(trainer) -> list:
    keys = ("loss", "grad_norm", "eval_loss", "eval_agreement")
    return [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if any(k in h for k in keys)]


def _weights(model) -> dict:
    return {n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _result(trainer, clock) -> dict:
    """What a run is compared on; the trainer itself is not kept, so its model and optimizer
    state are gone before the next run (its memory would count in that run's peak)."""
    return {
        "logged": _logged(trainer),
        "weights": _weights(trainer.model),
        "report": getattr(trainer, "offload_report", None) or {},
        **clock.summary(),
    }


def _compare(cell: str, ref: dict, got: dict, note: str = "") -> dict:
    logged_equal = ref["logged"] == got["logged"] and len(ref["logged"]) >= STEPS
    weights_equal = _same_weights(ref["weights"], got["weights"])
    parity = "bitwise (every logged value, trained weights)" if logged_equal and weights_equal else "DIFFERS"
    if parity == "DIFFERS":
        note = (note + f"; logged without {ref['logged'][:2]} with {got['logged'][:2]}").strip("; ")
    moved = (got["report"].get("activations") or {}).get("offloaded_bytes")
    if moved is not None:  # the counters run over the whole training
        note = (note + f"; {moved / STEPS / GIB:.2f} GiB offloaded an optimizer step").strip("; ")
    return {
        "cell": cell,
        "status": "works",
        "parity": parity,
        "peak_without_gib": ref["peak_gib"],
        "peak_with_gib": got["peak_gib"],
        "time_ratio": got["step_s"] / ref["step_s"],
        "step_without_s": ref["step_s"],
        "steps_without_s": ref["steps_s"],
        "steps_with_s": got["steps_s"],
        "peaks_without_gib": ref["peaks_gib"],
        "peaks_with_gib": got["peaks_gib"],
        "note": note,
    }


# --- TRL ---------------------------------------------------------------------------------


def _sft_run(folder, name, seq_len, *, mixin=None, ckpt=False, trl_offloading=False, lora=None):
    import datasets
    import trl

    text = load_texts()[0]
    rows = [text[i : i + seq_len] for i in range(0, len(text) - seq_len, seq_len // 2)][: 2 * STEPS]
    cls = type("SFT", (ActivationOffloadingMixin, trl.SFTTrainer), {}) if mixin is not None else trl.SFTTrainer
    args = trl.SFTConfig(
        **_args_common(folder, name, ckpt),
        max_length=seq_len,
        packing=False,
        activation_offloading=trl_offloading,
    )
    clock = step_clock()
    extra = {"offload_config": mixin} if mixin is not None else {}
    trainer = cls(
        model=lora_model(seq_len, **(lora or {})),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"text": rows}),
        processing_class=byte_tokenizer(),
        callbacks=[clock],
        **extra,
    )
    trainer.train()
    return _result(trainer, clock)


def cells_sft(args, label="TRL SFTTrainer (LoRA)", lora=None):
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for mode, (config, ckpt) in MODES.items():
            cell = f"{label}: {mode}" + (" (vs checkpointing)" if ckpt else "")
            try:
                ref = _sft_run(folder, "plain", args.seq_len, ckpt=ckpt, lora=lora)
                _clean()
                got = _sft_run(folder, "ours", args.seq_len, mixin=config, ckpt=ckpt, lora=lora)
                rows.append(_compare(cell, ref, got))
            except Exception as exc:  # noqa: BLE001 - a failing cell is a result
                rows.append({"cell": cell, "status": "failed", "note": _why(exc)})
                continue
            _clean()
            if lora is None:  # TRL's own engine on the same runs, for comparison
                trl_cell = f"{cell}, TRL's own activation_offloading instead"
                try:
                    trl_own = _sft_run(folder, "trl", args.seq_len, ckpt=ckpt, trl_offloading=True)
                    rows.append(_compare(trl_cell, ref, trl_own))
                except Exception as exc:  # noqa: BLE001
                    rows.append({"cell": trl_cell, "status": "failed", "note": _why(exc)})
                _clean()
    return rows


def cells_peft(args):
    """The PEFT variants through SFTTrainer: DoRA, and ``modules_to_save`` (a fully trained
    copy of the output head beside the adapters)."""
    return cells_sft(args, "PEFT DoRA (SFTTrainer)", lora={"use_dora": True}) + cells_sft(
        args, "PEFT LoRA + modules_to_save=[lm_head] (SFTTrainer)", lora={"modules_to_save": ["lm_head"]}
    )


def _dpo_run(folder, name, seq_len, *, mixin=None, ckpt=False):
    import datasets
    import trl

    text = load_texts()[0]
    third = seq_len // 2
    starts = range(0, len(text) - 3 * third, 997)
    rows = {
        "prompt": [text[i : i + third] for i in starts],
        "chosen": [text[i + third : i + 2 * third] for i in starts],
        "rejected": [text[i + 2 * third : i + 3 * third] for i in starts],
    }
    rows = {k: v[: 2 * STEPS] for k, v in rows.items()}
    cls = type("DPO", (ActivationOffloadingMixin, trl.DPOTrainer), {}) if mixin is not None else trl.DPOTrainer
    args = trl.DPOConfig(**_args_common(folder, name, ckpt), max_length=seq_len)
    clock = step_clock()
    extra = {"offload_config": mixin} if mixin is not None else {}
    trainer = cls(
        model=lora_model(seq_len),
        args=args,
        train_dataset=datasets.Dataset.from_dict(rows),
        processing_class=byte_tokenizer(),
        callbacks=[clock],
        **extra,
    )
    trainer.train()
    return _result(trainer, clock)


def cells_dpo(args):
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for mode, (config, ckpt) in MODES.items():
            cell = (
                "TRL DPOTrainer (LoRA; policy and reference passes): " + mode + (" (vs checkpointing)" if ckpt else "")
            )
            try:
                ref = _dpo_run(folder, "plain", args.seq_len, ckpt=ckpt)
                _clean()
                got = _dpo_run(folder, "ours", args.seq_len, mixin=config, ckpt=ckpt)
                rows.append(_compare(cell, ref, got))
            except Exception as exc:  # noqa: BLE001
                rows.append({"cell": cell, "status": "failed", "note": _why(exc)})
            _clean()
    return rows


# --- the Trainer's loops -------------------------------------------------------------------


def _token_rows(seq_len: int, count: int, start: int = 0) -> list[dict]:
    ids = list(load_texts()[0].encode("utf-8"))
    out = []
    for k in range(count):
        at = (start + k * 1009) % (len(ids) - seq_len)
        row = torch.tensor(ids[at : at + seq_len])
        out.append({"input_ids": row, "labels": row.clone()})
    return out


def _agreement(pred) -> dict:
    """Share of next-token argmaxes equal to the label: needs real logits at evaluation."""
    guesses, labels = pred.predictions, pred.label_ids
    return {"agreement": float((guesses[:, :-1] == labels[:, 1:]).mean())}


def _loop_run(folder, name, seq_len, *, mixin=None, reentrant=False, steps=STEPS, save_steps=None, resume=None):
    import transformers

    cls = type("Mixed", (ActivationOffloadingMixin, transformers.Trainer), {}) if mixin is not None else None
    cls = cls or transformers.Trainer
    common = _args_common(folder, name, True, remove_unused_columns=False)
    common.update(
        max_steps=steps,
        gradient_accumulation_steps=4,
        eval_strategy="steps",
        eval_steps=3,
        per_device_eval_batch_size=2,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
    )
    clock = step_clock()
    extra = {"offload_config": mixin} if mixin is not None else {}
    model = lora_model(seq_len)
    trainer = cls(
        model=model,
        args=transformers.TrainingArguments(**common),
        train_dataset=_token_rows(seq_len, 8 * STEPS),
        eval_dataset=_token_rows(seq_len, 4, start=500),
        compute_metrics=_agreement,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        callbacks=[clock],
        **extra,
    )
    trainer.train(resume_from_checkpoint=resume)
    result = _result(trainer, clock)
    prompt = torch.tensor([list(b"First Citizen:")], device=model.device)
    with torch.no_grad():
        result["generated"] = model.generate(input_ids=prompt, max_new_tokens=16, do_sample=False).tolist()
    return result


def cells_loops(args):
    ckpt_input = MODES["checkpoint-input offload"][0]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for reentrant in (False, True):
            kind = "reentrant" if reentrant else "non-reentrant"
            cell = (
                f"Trainer: gradient accumulation 4, evaluation with compute_metrics every 3 steps, "
                f"{kind} checkpointing; checkpoint-input offload (vs checkpointing)"
            )
            try:
                ref = _loop_run(folder, f"plain-{kind}", args.seq_len, reentrant=reentrant)
                _clean()
                got = _loop_run(folder, f"ours-{kind}", args.seq_len, mixin=ckpt_input, reentrant=reentrant)
                row = _compare(cell, ref, got)
                if ref["generated"] != got["generated"]:
                    row["parity"] = "DIFFERS (generate() after training)"
                else:
                    row["note"] = (row["note"] + "; generate() after training gives the same tokens").strip("; ")
                rows.append(row)
            except Exception as exc:  # noqa: BLE001
                rows.append({"cell": cell, "status": "failed", "note": _why(exc)})
            _clean()
        cell = f"Trainer: saved at step 3 and resumed to step {STEPS}, with the mixin (vs uninterrupted with the mixin)"
        try:
            whole = _loop_run(folder, "whole", args.seq_len, mixin=ckpt_input, save_steps=3)
            _clean()
            _loop_run(folder, "first-half", args.seq_len, mixin=ckpt_input, save_steps=3, steps=3)
            _clean()
            resumed = _loop_run(
                folder,
                "first-half",
                args.seq_len,
                mixin=ckpt_input,
                save_steps=3,
                resume=os.path.join(folder, "first-half", "checkpoint-3"),
            )
            # The resumed trainer's log starts with the first half's records, from the checkpoint.
            same = whole["logged"] == resumed["logged"] and _same_weights(whole["weights"], resumed["weights"])
            rows.append(
                {
                    "cell": cell,
                    "status": "works",
                    "parity": f"bitwise (the log of steps 1-{STEPS}, trained weights)" if same else "DIFFERS",
                    "note": f"{len(resumed['logged'])} records logged after resuming",
                }
            )
        except Exception as exc:  # noqa: BLE001
            rows.append({"cell": cell, "status": "failed", "note": _why(exc)})
    return rows


CELLS = {"sft": cells_sft, "dpo": cells_dpo, "peft": cells_peft, "loops": cells_loops}


def table(rows) -> str:
    lines = [
        "| cell | result | parity | peak GiB without -> with | step time ratio (step without) | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "works":
            lines.append(f"| {r['cell']} | {r['status']} | | | | {r['note']} |")
        elif "peak_with_gib" not in r:
            lines.append(f"| {r['cell']} | works | {r['parity']} | | | {r['note']} |")
        else:
            lines.append(
                f"| {r['cell']} | works | {r['parity']} | {r['peak_without_gib']:.2f} -> {r['peak_with_gib']:.2f} | "
                f"{r['time_ratio']:.3f} ({r['step_without_s'] * 1000:.0f} ms) | {r['note']} |"
            )
    return "\n".join(lines)


def main():
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import peft
    import trl

    header = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu (dry run)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "peft": peft.__version__,
        "seq_len": args.seq_len,
    }
    rows: list[dict] = []
    for name in args.cells.split(","):
        start = time.perf_counter()
        got = CELLS[name](args)
        rows += got
        for r in got:
            print(json.dumps(r), flush=True)
        print(f"== {name} in {time.perf_counter() - start:.0f} s", flush=True)
        with open(os.path.join(args.out, "compat-trainers.json"), "w") as f:
            json.dump({**header, "cells": rows}, f, indent=1)
    text = (
        f"{header['device']}, torch {header['torch']}, transformers {header['transformers']}, trl {header['trl']}, "
        f"peft {header['peft']}; {args.seq_len} tokens a sequence, 2 sequences a batch, eager attention\n\n"
        + table(rows)
    )
    with open(os.path.join(args.out, "compat-trainers.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
