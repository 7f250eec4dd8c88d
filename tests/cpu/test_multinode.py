"""Two hosts simulated on one machine: two ``torchrun`` launchers (``--nnodes 2``, node ranks 0
and 1, a c10d rendezvous on localhost), two ranks each, each host with its own spill directory
and RAM budget. Each rank's budgets are its host's shared by that host's ranks only; DDP over
the four ranks with block inputs spilled to each host's disk gives the single-process step."""

import os
import sys

import pytest

from tests.torchrun import torchrun_hosts

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")

WORKER = os.path.join(os.path.dirname(__file__), "dist", "multinode_worker.py")


def run_two_hosts(tmp_path, env_for_host=lambda node: {}):
    """Both hosts' launchers; asserts that every rank passed, on its own host's directory."""
    host_envs = []
    for node in (0, 1):
        node_dir = tmp_path / f"host{node}"
        node_dir.mkdir()
        # The hosts differ: 8 and 16 GiB of RAM.
        host_envs.append(dict(NODE_DIR=str(node_dir), NODE_HOST_BYTES=str((8 + 8 * node) << 30), **env_for_host(node)))
    outputs = torchrun_hosts(WORKER, host_envs)
    for code, out, err in outputs:
        assert code == 0, out[-2000:] + err[-4000:]
    text = "".join(out for _, out, _ in outputs)
    assert text.count("RESULT multinode") == 4, text
    for node in (0, 1):
        assert text.count(f"node_dir={tmp_path / f'host{node}'} ") == 2, text


def test_two_hosts_of_two_ranks_each_with_their_own_budgets_and_directories(tmp_path):
    run_two_hosts(tmp_path)
