"""What a result file records about the run that made it: the commit, the GPU, the versions
and the command line. Every writer of benchmark results adds it under ``"provenance"``, and
``benchmarks/results_index.py`` reads it back."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from importlib import metadata

import torch

__all__ = ["provenance", "source_commit"]

COMMIT_ENV = "OFFLOADKIT_COMMIT"


def source_commit() -> str | None:
    """The commit of the offloadkit checkout that is running: ``git rev-parse HEAD`` where the
    package's own directory is the top of a git checkout (not the working directory, which may
    be another checkout; nor a repository around a tree copied without ``.git``, whose HEAD is
    not this tree's), else ``$OFFLOADKIT_COMMIT`` (set for such a copy), else None.

    Where tracked files differ from that HEAD (edits not committed, or a newer tree copied
    over an older checkout), HEAD is not what ran: ``$OFFLOADKIT_COMMIT`` if set, else HEAD
    marked ``-dirty``."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = _git(here, "rev-parse", "--show-toplevel", "HEAD")
    if out is not None and out.returncode == 0:
        lines = out.stdout.split()
        if len(lines) == 2 and os.path.realpath(lines[0]) == os.path.realpath(here):
            if not _tracked_changes(here):
                return lines[1]
            return os.environ.get(COMMIT_ENV) or f"{lines[1]}-dirty"
    return os.environ.get(COMMIT_ENV) or None


def _git(cwd: str, *args: str) -> subprocess.CompletedProcess | None:
    """``git args`` run in ``cwd`` (None where git cannot run)."""
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None


def _tracked_changes(top: str) -> bool:
    """Whether tracked files in the checkout at ``top`` differ from its HEAD (True if unknown)."""
    out = _git(top, "--no-optional-locks", "status", "--porcelain", "--untracked-files=no")
    return out is None or out.returncode != 0 or bool(out.stdout.strip())


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def provenance(argv: list[str] | None = None) -> dict:
    """The run's commit, GPU name (None without CUDA), torch and transformers versions (None
    when not installed) and command line (``sys.argv``, also as one shell-quoted string)."""
    argv = list(sys.argv if argv is None else argv)
    return {
        "commit": source_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "command": shlex.join(argv),
        "argv": argv,
    }
