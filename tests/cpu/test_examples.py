"""The configs in examples/ are what ``offloadkit train`` accepts: each loads through its
loader and validates as for a GPU machine and a CPU-only one, with no warning from the
loader; the CPU quickstart trains two steps through the command."""

import glob
import os
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("yaml")

from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import load_mapping  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(glob.glob(os.path.join(REPO, "examples", "*.yaml")))


def test_there_are_examples_and_each_is_listed_in_the_readme():
    assert 4 <= len(EXAMPLES) <= 8
    with open(os.path.join(REPO, "examples", "README.md")) as f:
        readme = f.read()
    for path in EXAMPLES:
        assert f"]({os.path.basename(path)})" in readme, os.path.basename(path)


@pytest.mark.parametrize("cuda", [True, False], ids=["gpu", "cpu"])
@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_loads_and_validates(path, cuda):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = TrainConfig.from_dict(load_mapping(path), source=path, cuda=cuda)
        cfg.validate(path)
        resolved = cfg.resolved(cuda)
    # Built-in shapes and the shipped corpus: nothing to download or to point at.
    assert cfg.model is None and cfg.dataset is None and not cfg.datasets
    assert resolved.seq_len and resolved.batch_size
    messages = [str(w.message) for w in caught if "offloadkit" in str(w.message) or w.category is UserWarning]
    assert not messages, messages


def test_quickstart_trains_two_steps_on_cpu(tmp_path):
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadkit",
            "train",
            os.path.join(REPO, "examples", "quickstart-cpu.yaml"),
            "--max-steps",
            "2",
            "--output-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES=""),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "training 2 steps" in proc.stdout, proc.stdout[-3000:]
    assert (out / "report.json").is_file()
    assert (out / "model").is_dir()
