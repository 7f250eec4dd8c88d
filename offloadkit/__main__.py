"""Command line: ``offloadkit demo`` (and, as they land, ``train`` and ``bench``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offloadkit", description="Train models that do not fit in GPU memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small Llama-style model with and without offloading")
    demo.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    demo.add_argument("--shape", default="small", help="model shape: tiny, small (default), llama-3.2-1b, llama-3-8b")
    demo.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    demo.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from offloadkit.demo import run_demo

        return 0 if run_demo(args.steps, args.shape, args.seq_len, args.batch, args.device) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
