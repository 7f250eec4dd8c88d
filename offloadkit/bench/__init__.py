"""Benchmark harness: memory-saving modes side by side on Llama-shaped models."""

from offloadkit.bench.harness import (
    BenchConfig,
    format_table,
    run_benchmark,
    save_report,
)

__all__ = ["BenchConfig", "format_table", "run_benchmark", "save_report"]
