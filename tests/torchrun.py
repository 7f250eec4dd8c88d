"""Start a test worker under ``torchrun`` (two processes by default, one host) and hand back
the finished process: the launch every multi-process test shares."""

import os
import socket
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


def torchrun_hosts(worker: str, host_envs: list[dict], nproc: int = 2, timeout: float = 240) -> list[tuple]:
    """Several hosts simulated on this machine: one ``torchrun`` launcher a host (``--nnodes``,
    its ``--node_rank``, a c10d rendezvous on localhost), ``nproc`` ranks each, each launcher with
    its host's environment. Returns ``(returncode, stdout, stderr)`` per host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launchers = []
    for node, host_env in enumerate(host_envs):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd(), **host_env)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(host_envs)),
            "--nproc_per_node", str(nproc), "--node_rank", str(node), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "offloadkit-hosts", worker,
        ]  # fmt: skip
        launchers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outputs = []
    for proc in launchers:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in launchers:
                p.kill()
            raise
        outputs.append((proc.returncode, out, err))
    return outputs
