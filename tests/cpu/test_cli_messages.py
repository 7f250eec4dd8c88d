"""``offloadkit train``'s one-line errors for a dataset that is not UTF-8 and for a config of
unknown keys, as a user sees them: the file or the keys named, the fix, and no more."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFIX = "offloadkit: error: "


def _error_line(config, cwd) -> str:
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "offloadkit", "train", config.name],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path),
        timeout=600,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 1, proc.stderr
    return lines[0][len(PREFIX) :]


def test_a_dataset_that_is_not_utf8_names_the_file_the_byte_and_the_fix(tmp_path):
    (tmp_path / "train.txt").write_bytes("Un café, deux cafés.\n".encode("latin1") * 50)
    config = tmp_path / "run.yaml"
    config.write_text(
        "model_shape: tiny\nseq_len: 16\nbatch_size: 2\nmax_steps: 1\ncompare: false\n"
        "output_dir: out\ndataset: train.txt\n"
    )
    line = _error_line(config, tmp_path)
    assert line.startswith("dataset: train.txt: not UTF-8 (byte 6, line 1); re-encode it as UTF-8"), line
    assert "iconv -f latin1 -t utf-8 train.txt > train.utf8.txt" in line and len(line) <= 200


def test_a_config_of_unknown_keys_is_one_short_line(tmp_path):
    # Axolotl's examples/cloud/modal.yaml: the cloud runner's settings, not a training config.
    config = tmp_path / "modal.yaml"
    config.write_text(
        "project_name:\nvolumes:\n  - name: axolotl-data\n    mount: /workspace/data\n"
        "secrets:\n  - HF_TOKEN\n  - WANDB_API_KEY\nbranch:\ndockerfile_commands:\ngpu: h100\ngpu_count: 1\n"
        "memory: 128\ntimeout: 86400\nmemory_preprocess: 32\ntimeout_preprocess: 14400\n"
    )
    line = _error_line(config, tmp_path)
    assert line.startswith("modal.yaml: 11 unknown keys: 'project_name', 'volumes',"), line
    assert line.endswith("more; see offloadkit train --help for the keys") and len(line) <= 200, line
