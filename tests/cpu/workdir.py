"""A working directory for CLI tests that is not the repository's: tests must neither read
nor write the directory they are started from (``scripts/run.sh`` leaves its run in the
repository root's ``offloadkit-output/``, and ``scripts/test.sh`` runs from there)."""

import os

import pytest


def _snapshot(root):
    entries = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            stat = os.stat(path)
            entries.append((os.path.relpath(path, root), stat.st_size, stat.st_mtime_ns))
    return sorted(entries)


@pytest.fixture(autouse=True)
def foreign_working_directory(tmp_path_factory, monkeypatch):
    """Run each test from a directory holding an earlier run in ``offloadkit-output/`` (the
    default output_dir), and fail it if it changed anything there."""
    cwd = tmp_path_factory.mktemp("cwd")
    earlier = cwd / "offloadkit-output"
    (earlier / "checkpoint-2").mkdir(parents=True)
    (earlier / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    (earlier / "model").mkdir()
    (earlier / "model" / "config.json").write_text("{}")
    (earlier / "report.json").write_text("{}")
    before = _snapshot(cwd)
    monkeypatch.chdir(cwd)
    yield cwd
    assert _snapshot(cwd) == before, "the test wrote to its working directory: give it paths under tmp_path"
