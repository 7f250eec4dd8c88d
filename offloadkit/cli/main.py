"""Argument parsing and one-line errors for the ``offloadkit`` command."""

from __future__ import annotations

import argparse
import sys
import textwrap
import warnings

__all__ = ["main", "build_parser"]


def _train_epilog() -> str:
    from offloadkit.cli.train_config import DEFAULT_STEPS, TrainConfig
    from offloadkit.config import OffloadConfig

    def wrap(title: str, keys: list[str]) -> str:
        return textwrap.fill(f"{title}: {', '.join(keys)}.", width=100, subsequent_indent="  ")

    return f"""\
The config file is flat YAML (or JSON), with offloadkit's keys or an Axolotl config's.
{wrap("Training keys", TrainConfig.train_keys())}
{wrap("Offloading keys", OffloadConfig.keys())}
activation_offloading is false | true | legacy | disk; sizes take units (host_budget_bytes: 16GiB).
Axolotl configs are read as written: base_model (a local directory, or a hub id from the
local Hugging Face cache, downloaded when the network allows), datasets (local files of
type completion, alpaca or chat_template), sequence_len, micro_batch_size, adapter: lora or
qlora, lora_r, load_in_8bit, bf16, ...; Axolotl's keys that change the training (warmup_ratio,
val_set_size, sample_packing, special_tokens, peft_use_rslora, lora_model_dir, ...) are the
training keys of the same name above. Keys that do not change the training (logging, hub,
kernels, multi-GPU layouts) are listed in one warning; a key that changes it and cannot be
honoured stops the run with one line naming it (--drop-unsupported-keys trains without it).

Without a config: a full fine-tune of the built-in small Llama model on the shipped
public-domain corpus, {DEFAULT_STEPS} steps, with gradient checkpointing and activation
offloading (to pinned RAM on a GPU, to disk on a CPU-only machine). Its first steps also
run without offloadkit, and the report compares the two: peak memory and step time.

Example config:
  model: /models/Llama-3.2-1B
  dataset: data/train.jsonl
  seq_len: 4096
  lora_rank: 16
  gradient_checkpointing: true
  activation_offloading: true
  layer_offloading: true
  save_steps: 50
"""


def _shapes() -> list[str]:
    from offloadkit.models.zoo import LLAMA_SHAPES

    return list(LLAMA_SHAPES)


def _version() -> str:
    from offloadkit import __version__

    return f"offloadkit {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offloadkit",
        description="Train and fine-tune models that do not fit in "
        "GPU memory: activation offloading, checkpoint-input offloading, layer streaming.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,check,bench,plan,demo}")

    train = sub.add_parser(
        "train",
        help="fine-tune a causal LM with the memory options of a config file",
        description="Fine-tune a causal language model through the Hugging Face Trainer with "
        "offloadkit's memory options, and compare its first steps with the same steps without "
        "offloadkit; writes the model/adapter, report.json, report.md and memory_timeline.png "
        "to output_dir.",
        epilog=_train_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", nargs="?", help="YAML or JSON config file (default: built-in defaults)")
    train.add_argument(
        "--config", dest="config_option", metavar="FILE", help="the config file (same as the positional)"
    )
    train.add_argument("--output-dir", help="override output_dir")
    train.add_argument("--max-steps", type=int, help="override max_steps")
    train.add_argument(
        "--resume-from-checkpoint",
        nargs="?",
        const=True,
        metavar="DIR",
        help="resume from DIR, or from the newest checkpoint in output_dir when DIR is omitted",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run in output_dir (its report, model and checkpoints) once this run has "
        "saved; until then it trains in output_dir/incomplete-run and the earlier run stays as it is",
    )
    train.add_argument(
        "--drop-unsupported-keys",
        action="store_true",
        help="train an Axolotl config without the keys offloadkit cannot honour (named in one warning and in "
        "the report) instead of refusing it (the key drop_unsupported_keys: true)",
    )

    from offloadkit.cli.check import add_check_parser

    add_check_parser(sub)

    bench = sub.add_parser(
        "bench",
        help="run memory-saving modes side by side on a model shape",
        description="Benchmark modes side by side (median step time, tokens/s, peak GPU memory "
        "allocated and reserved, host RSS); prints a table, writes JSON, Markdown and a plot. "
        "Without a GPU it runs on the CPU with the disk tier.",
    )
    bench.add_argument(
        "--shape",
        default=None,
        help=f"{', '.join(_shapes())} (default: llama-3.2-1b on a GPU, small on a CPU)",
    )
    bench.add_argument(
        "--seq-len", type=int, default=None, help="tokens in the sequence (default: 16384 on a GPU, 1024 on a CPU)"
    )
    bench.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on all linear layers (0: full fine-tune)")
    bench.add_argument(
        "--modes",
        default=None,
        help="semicolon-separated modes, each optionally with overrides, e.g. "
        "'ckpt;ckpt+offload@prefetch=4;ckpt+input_offload+layer_stream'",
    )
    bench.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    bench.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    bench.add_argument(
        "--prefetch", type=int, default=None, help="activation_loading_horizon (default: 2 from RAM, 4 from disk)"
    )
    bench.add_argument("--host-budget-gib", type=float, default=None, help="host RAM cap for offloaded bytes")
    bench.add_argument(
        "--storage",
        choices=["ram", "disk", "tiered"],
        default=None,
        help="where offloadkit modes put activations (default: ram on a GPU, disk on a CPU or when "
        "--disk-dir is given)",
    )
    bench.add_argument("--disk-dir", default=None, help="parent directory for disk-tier files")
    bench.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    bench.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    bench.add_argument("--name", default=None, help="file name stem (default <shape>-<seq_len>)")
    bench.add_argument("--list-modes", action="store_true", help="print each mode with what it does, and exit")

    from offloadkit.cli.plan import add_plan_parser

    add_plan_parser(sub)

    demo = sub.add_parser("demo", help="train a small model with and without offloading and compare")
    demo.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    demo.add_argument("--shape", default="small", help="model shape (default small)")
    demo.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    demo.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Our own warnings as one line each; other libraries' as Python shows them."""
    text = str(message)
    if text.startswith("offloadkit: "):
        print(f"offloadkit: warning: {text[len('offloadkit: ') :]}", file=sys.stderr)
    else:
        print(warnings.formatwarning(message, category, filename, lineno, line).rstrip(), file=sys.stderr)


def _train(args) -> None:
    from offloadkit.cli.train import TrainConfig, run_train
    from offloadkit.config import ConfigError

    if args.config and args.config_option and args.config != args.config_option:
        raise ConfigError(f"two config files given ({args.config!r} and --config {args.config_option!r}); give one")
    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError(f"--max-steps={args.max_steps} must be an integer >= 1")
    cfg = TrainConfig.from_file(args.config or args.config_option, drop_unsupported_keys=args.drop_unsupported_keys)
    if args.output_dir is not None:
        cfg.output_dir = args.output_dir
    if args.max_steps is not None:
        cfg.max_steps = args.max_steps
    if args.resume_from_checkpoint is not None:
        cfg.resume_from_checkpoint = args.resume_from_checkpoint
    if args.overwrite:
        cfg.overwrite_output_dir = True
    cfg.validate("command line")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # saving shards draws a bar; offloadkit's own is enough
    run_train(cfg)


# Optional packages that log at import what a CPU machine lacks (CUDA-only extensions, hub
# kernels): not the user's to act on, and they would bury offloadkit's one-line messages.
_QUIET_LOGGERS = ("torchao", "bitsandbytes", "torch.utils._pytree")


def main(argv: list[str] | None = None) -> int:
    import logging

    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    from offloadkit.cli.errors import TrainingFailedError
    from offloadkit.config import ConfigError

    # Deprecation chatter from the libraries we drive is not the user's to fix.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.showwarning = _show_warning

    try:
        if args.command == "train":
            _train(args)
            return 0
        if args.command == "check":
            from offloadkit.cli.check import run_check

            return run_check(args)
        if args.command == "bench":
            from offloadkit.cli.bench import list_modes, run_bench

            if args.list_modes:
                print(list_modes())
                return 0
            run_bench(args)
            return 0
        if args.command == "plan":
            from offloadkit.cli.plan import run_plan

            return run_plan(args)
        from offloadkit.demo import run_demo

        return 0 if run_demo(args.steps, args.shape, args.seq_len, args.batch, args.device) else 1
    except (ConfigError, FileNotFoundError, ImportError, ValueError, OSError) as exc:
        print(f"offloadkit: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except TrainingFailedError as exc:
        print(f"offloadkit: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"offloadkit: {str(exc) or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
