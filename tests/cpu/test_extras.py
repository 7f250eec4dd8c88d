"""A missing optional package names the extra that installs it, in one line: the helpers of
offloadkit/extras.py, and the entry points a user reaches on a base install (``offloadkit
train``, OffloadCallback, LoRA, QLoRA, YAML configs, the memory timeline)."""

import os
import subprocess
import sys
import textwrap

import pytest

from offloadkit.config import ConfigError, load_mapping
from offloadkit.extras import EXTRAS, MissingExtraError, available, check, message, needs, require

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run before the code under test: imports of the named packages fail as if not installed.
_BLOCKER = textwrap.dedent(
    """
    import sys
    class _Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {blocked!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, _Blocked())
    """
)


def _python(code: str, blocked: tuple[str, ...], cwd) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER.format(blocked=set(blocked)) + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=path),
        timeout=120,
    )


def test_every_extra_named_is_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for module, extra in EXTRAS.items():
        assert extra in extras, (module, extra)
        wanted = {"yaml": "pyyaml"}.get(module, module)
        assert any(req.lower().replace("-", "_").startswith(wanted) for req in extras[extra]), (module, extra)


def test_message_is_one_line_naming_the_extra():
    assert (
        message("transformers", "offloadkit train")
        == "offloadkit train needs transformers: pip install 'offloadkit[hf]'"
    )
    assert message(["transformers", "yaml"], "x") == "x needs transformers and yaml: pip install 'offloadkit[hf,yaml]'"


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import then raises ModuleNotFoundError
    with pytest.raises(MissingExtraError, match=r"^LoRA needs transformers: pip install 'offloadkit\[hf\]'$"):
        require("transformers", "hf", "LoRA")
    assert not available("transformers")
    with pytest.raises(ImportError, match=r"offloadkit\[hf\]"):
        check(("transformers", "os"), "offloadkit train")


def test_needs_wraps_optional_packages_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"plotting needs matplotlib: pip install 'offloadkit\[plot\]'"):
        with needs("plotting"):
            import matplotlib  # noqa: F401
    # A module offloadkit does not know of: the original error, unchanged.
    with pytest.raises(ModuleNotFoundError) as info:
        with needs("plotting"):
            import offloadkit_no_such_module  # noqa: F401
    assert not isinstance(info.value, MissingExtraError)


def test_yaml_config_without_pyyaml(tmp_path, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text("model_shape: tiny\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ConfigError, match=r"reading run.yaml needs yaml: pip install 'offloadkit\[yaml\]'"):
        load_mapping(str(path))
    (tmp_path / "run.json").write_text('{"model_shape": "tiny"}')
    assert load_mapping(str(tmp_path / "run.json")) == {"model_shape": "tiny"}


def test_lora_without_peft(monkeypatch):
    from offloadkit.integrations.peft_utils import require_peft

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"LoRA needs peft: pip install 'offloadkit\[hf\]'"):
        require_peft()


def test_qlora_without_bitsandbytes(monkeypatch):
    pytest.importorskip("transformers")
    from offloadkit.cli.build import _load_quantized
    from offloadkit.cli.train_config import TrainConfig

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match=r"bitsandbytes: pip install 'offloadkit\[qlora\]'"):
        _load_quantized(TrainConfig(load_in_4bit=True), "cpu", None)


def test_timeline_without_matplotlib(tmp_path, monkeypatch):
    from offloadkit.cli.measure import RunMeasure
    from offloadkit.cli.plot import plot_timelines

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    run = RunMeasure(label="with offloadkit", samples=[(0.0, 1, 0, 0)])
    path, reason = plot_timelines(
        [run], str(tmp_path / "t.png"), title="t", memory_label="m", profile_step=0, steps_run=1
    )
    assert path is None
    assert reason == "skipped: the memory timeline needs matplotlib: pip install 'offloadkit[plot]'"


@pytest.mark.parametrize("blocked", [("transformers",), ("accelerate",), ("transformers", "accelerate")])
def test_offloadkit_train_on_a_base_install(tmp_path, blocked):
    """The command as run: one line on stderr, exit status 2, no traceback."""
    proc = _python(
        """
        from offloadkit.cli.main import main
        sys.exit(main(["train"]))
        """,
        blocked,
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        f"offloadkit: error: offloadkit train needs {' and '.join(blocked)}: pip install 'offloadkit[hf]'"
    )
    assert not os.listdir(tmp_path)  # nothing written


def test_offload_callback_without_transformers(tmp_path):
    proc = _python(
        """
        from offloadkit.integrations.trainer import OffloadCallback, ActivationOffloadingMixin
        try:
            OffloadCallback()
        except ImportError as exc:
            print(exc)
        """,
        ("transformers",),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OffloadCallback needs transformers: pip install 'offloadkit[hf]'"
