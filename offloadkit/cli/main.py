"""Argument parsing and one-line errors for the ``offloadkit`` command."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]

_TRAIN_EPILOG = """\
The config file is flat YAML (or JSON). Training keys: model, model_shape, dataset,
text_field, output_dir, seq_len, batch_size, gradient_accumulation_steps, max_steps,
learning_rate, warmup_steps, logging_steps, lora_rank, dtype, seed, profile_step.
Offloading keys: gradient_checkpointing, selective_checkpointing, activation_offloading
(false | true | legacy | disk), activation_loading_horizon, prefetch_bytes,
min_offload_size, max_fwd_stash_size, use_pin_memory, host_budget_bytes (e.g. 16GiB),
host_min_free_bytes,
disk_dir, disk_threads, direct_io, disk_tiering, layer_offloading, layer_offloading_depth.

Without a config: the built-in small Llama model on the shipped public-domain corpus,
LoRA rank 8, 40 steps, gradient checkpointing, and activation offloading to pinned RAM
plus layer streaming on a GPU (activation offloading to disk on a CPU-only machine).

Example config:
  model_shape: llama-3.2-1b
  seq_len: 4096
  lora_rank: 16
  gradient_checkpointing: true
  activation_offloading: true
  layer_offloading: true
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offloadkit", description="Train and fine-tune models that do not fit in "
                                     "GPU memory: activation offloading, checkpoint-input offloading, layer streaming.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,bench,plan,demo}")

    train = sub.add_parser("train", help="fine-tune a causal LM with the memory options of a config file",
                           description="Fine-tune a causal language model through the Hugging Face Trainer with "
                           "offloadkit's memory options; writes the model/adapter, report.json, report.md and "
                           "memory_timeline.png to output_dir.", epilog=_TRAIN_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", nargs="?", help="YAML or JSON config file (default: built-in defaults)")
    train.add_argument("--output-dir", help="override output_dir")
    train.add_argument("--max-steps", type=int, help="override max_steps")

    bench = sub.add_parser("bench", help="run memory-saving modes side by side on a model shape",
                           description="Benchmark modes side by side (median step time, tokens/s, peak GPU memory "
                           "allocated and reserved, host RSS); prints a table, writes JSON, Markdown and a plot.")
    bench.add_argument("--shape", default="llama-3.2-1b", help="tiny, small, llama-3.2-1b (default) or llama-3-8b")
    bench.add_argument("--seq-len", type=int, default=16384, help="tokens in the sequence (default 16384)")
    bench.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on all linear layers (0: full fine-tune)")
    bench.add_argument("--modes", default=None, help="semicolon-separated modes, each optionally with overrides, e.g. "
                       "'ckpt;ckpt+offload@prefetch=4;ckpt+input_offload+layer_stream'")
    bench.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    bench.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    bench.add_argument("--prefetch", type=int, default=None,
                       help="activation_loading_horizon (default: 2 from RAM, 4 from disk)")
    bench.add_argument("--host-budget-gib", type=float, default=None, help="host RAM cap for offloaded bytes")
    bench.add_argument("--disk-dir", default=None, help="parent directory for disk-tier files")
    bench.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    bench.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    bench.add_argument("--name", default=None, help="file name stem (default <shape>-<seq_len>)")

    from offloadkit.cli.plan import add_plan_parser

    add_plan_parser(sub)

    demo = sub.add_parser("demo", help="train a small model with and without offloading and compare")
    demo.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    demo.add_argument("--shape", default="small", help="model shape (default small)")
    demo.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    demo.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import warnings

    from offloadkit.config import ConfigError

    # Deprecation chatter from the libraries we drive is not the user's to fix.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)

    try:
        if args.command == "train":
            from offloadkit.cli.train import TrainConfig, run_train

            cfg = TrainConfig.from_file(args.config)
            if args.output_dir:
                cfg.output_dir = args.output_dir
            if args.max_steps:
                cfg.max_steps = args.max_steps
                cfg.validate()
            run_train(cfg)
            return 0
        if args.command == "bench":
            from offloadkit.cli.bench import run_bench

            run_bench(args)
            return 0
        if args.command == "plan":
            from offloadkit.cli.plan import run_plan

            return run_plan(args)
        from offloadkit.demo import run_demo

        return 0 if run_demo(args.steps, args.shape, args.seq_len, args.batch, args.device) else 1
    except (ConfigError, FileNotFoundError, ImportError, ValueError) as exc:
        print(f"offloadkit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("offloadkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
