"""Start a test worker under ``torchrun`` (two processes by default, one host) and hand back
the finished process: the launch every multi-process test shares."""

import os
import subprocess
import sys

# NVLink multicast off: the lent multi-GPU hosts do not support it.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def torchrun(worker: str, *args: str, nproc: int = 2, timeout: float = 300, env: dict | None = None):
    """Run ``worker`` with ``args`` on ``nproc`` local ranks; the repository on ``PYTHONPATH``,
    one CPU thread a rank. Returns the ``subprocess.CompletedProcess`` (text output)."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd(), **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone", worker]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def assert_ranks_reported(proc, checks, ranks: int = 2) -> None:
    """The run ended well and every check printed ``RESULT <check> `` once a rank."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for check in checks:
        assert proc.stdout.count(f"RESULT {check} ") == ranks, (check, proc.stdout[-2000:])
