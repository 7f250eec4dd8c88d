"""Result files record the run that made them: the commit, the GPU, torch and transformers
versions and the command line, under ``"provenance"``."""

import json
import shlex
import shutil
import subprocess

import pytest
import torch

from offloadkit.bench import provenance as prov_module
from offloadkit.bench import save_report
from offloadkit.bench.provenance import COMMIT_ENV, provenance, source_commit


def _git_head() -> str | None:
    if shutil.which("git") is None:
        return None
    out = subprocess.run(
        ["git", "rev-parse", "HEAD"],
        cwd=prov_module.__file__.rsplit("/offloadkit/", 1)[0],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def test_provenance_records_the_run(monkeypatch):
    monkeypatch.delenv(COMMIT_ENV, raising=False)
    got = provenance(["benchmarks/capacity.py", "--shape", "llama-3-8b", "--probes", "everything:65536:32:1:2"])
    assert set(got) == {"commit", "gpu", "torch", "transformers", "command", "argv"}
    assert got["torch"] == torch.__version__
    assert got["command"] == "benchmarks/capacity.py --shape llama-3-8b --probes everything:65536:32:1:2"
    assert shlex.split(got["command"]) == got["argv"]
    head = _git_head()  # None outside a git checkout, without the variable
    assert got["commit"] in (head, f"{head}-dirty")  # -dirty: tracked files edited since HEAD
    if not torch.cuda.is_available():
        assert got["gpu"] is None
    json.dumps(got)  # it goes into JSON as it is


def test_provenance_defaults_to_sys_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["prog", "a b"])
    assert provenance()["command"] == "prog 'a b'"


def _no_git(*args, **kwargs):
    raise FileNotFoundError("git")


def test_the_commit_falls_back_to_the_environment_then_none(monkeypatch):
    monkeypatch.setattr(prov_module.subprocess, "run", _no_git)
    monkeypatch.setenv(COMMIT_ENV, "0123abc")
    assert source_commit() == "0123abc"
    monkeypatch.delenv(COMMIT_ENV)
    assert source_commit() is None

    def outside_a_checkout(*args, **kwargs):
        return subprocess.CompletedProcess(args, 128, stdout="", stderr="fatal: not a git repository")

    monkeypatch.setattr(prov_module.subprocess, "run", outside_a_checkout)
    monkeypatch.setenv(COMMIT_ENV, "4567def")
    assert source_commit() == "4567def"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_wins_over_the_environment(monkeypatch):
    head = _git_head()
    if head is None:
        pytest.skip("not a git checkout")
    if prov_module._tracked_changes(prov_module.__file__.rsplit("/offloadkit/", 1)[0]):
        pytest.skip("tracked files differ from HEAD here")
    monkeypatch.setenv(COMMIT_ENV, "not-this-one")
    assert source_commit() == head


def _checkout_with_provenance(tmp_path):
    """A git checkout holding a copy of the module at offloadkit/bench/, committed; the copy
    loaded, and its HEAD."""
    import importlib.util

    top = tmp_path / "checkout"
    copied = top / "offloadkit" / "bench" / "provenance.py"
    copied.parent.mkdir(parents=True)
    shutil.copy(prov_module.__file__, copied)
    ident = ["-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run(["git", "init", "-q", str(top)], check=True)
    subprocess.run(["git", "-C", str(top), "add", "."], check=True)
    subprocess.run(["git", "-C", str(top), *ident, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run(["git", "-C", str(top), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    spec = importlib.util.spec_from_file_location("provenance_checkout", copied)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, copied, head


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_tree_that_differs_from_its_head_is_not_called_head(tmp_path, monkeypatch):
    """A newer tree copied over an older checkout (or edits not committed): HEAD is not what
    ran. The commit the operator gives wins then; without one, HEAD marked -dirty."""
    module, copied, head = _checkout_with_provenance(tmp_path)
    monkeypatch.delenv(COMMIT_ENV, raising=False)
    assert module.source_commit() == head
    copied.write_text(copied.read_text() + "\n# changed\n")
    assert module.source_commit() == f"{head}-dirty"
    monkeypatch.setenv(COMMIT_ENV, "feedbee")
    assert module.source_commit() == "feedbee"


def test_save_report_writes_provenance_and_keeps_a_reports_own(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["offloadkit", "bench", "--shape", "small"])
    report = {"device": "CPU x86_64", "torch": torch.__version__, "results": []}
    path = tmp_path / "r.json"
    save_report(report, str(path))
    written = json.loads(path.read_text())
    assert written["provenance"]["command"] == "offloadkit bench --shape small"
    assert written["provenance"]["torch"] == torch.__version__
    assert "provenance" not in report  # the caller's dict is left as it was
    own = {**report, "provenance": {"commit": "abc"}}
    save_report(own, str(path))
    assert json.loads(path.read_text())["provenance"] == {"commit": "abc"}


def test_a_tree_copied_into_another_checkout_takes_the_commit_it_was_given(tmp_path, monkeypatch):
    """A ``git archive`` of the tree unpacked inside the repository (how a device run gets its
    code): git answers with the surrounding repository's HEAD, which is not this tree's; the
    commit is the one ``$OFFLOADKIT_COMMIT`` names."""
    import importlib.util

    if shutil.which("git") is None:
        pytest.skip("needs git")
    outer = tmp_path / "outer"
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    ident = ["-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run(["git", "-C", str(outer), *ident, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    copied = outer / "snap" / "offloadkit" / "bench" / "provenance.py"
    copied.parent.mkdir(parents=True)
    shutil.copy(prov_module.__file__, copied)
    spec = importlib.util.spec_from_file_location("provenance_copy", copied)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv(COMMIT_ENV, "feedbee")
    assert module.source_commit() == "feedbee"
    monkeypatch.delenv(COMMIT_ENV)
    assert module.source_commit() is None
