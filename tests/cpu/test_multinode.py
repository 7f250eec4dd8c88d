"""Two hosts simulated on one machine: two ``torchrun`` launchers (``--nnodes 2``, node ranks 0
and 1, a c10d rendezvous on localhost), two ranks each, each host with its own spill directory
and RAM budget. Each rank's budgets are its host's shared by that host's ranks only; DDP over
the four ranks with block inputs spilled to each host's disk gives the single-process step."""

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")

WORKER = os.path.join(os.path.dirname(__file__), "dist", "multinode_worker.py")


def test_two_hosts_of_two_ranks_each_with_their_own_budgets_and_directories(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launchers = []
    for node in (0, 1):
        node_dir = tmp_path / f"host{node}"
        node_dir.mkdir()
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.getcwd(),
            NODE_DIR=str(node_dir),
            NODE_HOST_BYTES=str((8 + 8 * node) << 30),  # the hosts differ: 8 and 16 GiB
        )
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
            "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
            "--rdzv_id", "offloadkit-multinode", WORKER,
        ]  # fmt: skip
        launchers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outputs = []
    for proc in launchers:
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in launchers:
                p.kill()
            raise
        outputs.append((proc.returncode, out, err))
    for code, out, err in outputs:
        assert code == 0, out[-2000:] + err[-4000:]
    text = "".join(out for _, out, _ in outputs)
    assert text.count("RESULT multinode") == 4, text
    for node in (0, 1):
        assert text.count(f"node_dir={tmp_path / f'host{node}'} ") == 2, text
