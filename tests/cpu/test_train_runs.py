"""``offloadkit train`` in this process, with a callback slipped into its Trainer to make a
run fail or be interrupted (a real SIGINT, to this process) at a chosen step: what
--overwrite keeps, what Ctrl-C saves, and what a resumed run reports."""

import hashlib
import json
import os
import signal

import pytest

transformers = pytest.importorskip("transformers")

import offloadkit.cli.train as train_module  # noqa: E402
from offloadkit.cli.main import main  # noqa: E402
from tests.cpu.test_cli import _tiny  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401


def _config(tmp_path, name="run.yaml", **keys):
    return str(_tiny(tmp_path, name=name, **keys))


_QUIET = train_module._quiet


def _at_step(monkeypatch, step, action):
    """Run ``action()`` at the end of optimizer step ``step`` of the next runs' Trainer."""

    class AtStep(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                action()

    def with_callback(trainer):
        trainer.add_callback(AtStep())
        return _QUIET(trainer)

    monkeypatch.setattr(train_module, "_quiet", with_callback)


def _fail():
    raise RuntimeError("injected failure")


def _files(folder):
    """Every file under ``folder``, by relative path, with a digest of its bytes."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def test_overwrite_that_fails_mid_training_leaves_the_earlier_run(tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert main(["train", _config(tmp_path, save_steps=2)]) == 0
    earlier = _files(out)
    assert {"report.json", "model/model.safetensors", "checkpoint-2/trainer_state.json"} <= set(earlier)

    # No checkpoint yet when it fails: nothing of the new run is kept.
    _at_step(monkeypatch, 1, _fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        main(["train", _config(tmp_path, max_steps=4), "--overwrite"])
    assert _files(out) == earlier

    # A checkpoint saved before the failure is kept apart, and the same command with
    # --resume-from-checkpoint continues it, then replaces the earlier run.
    again = _config(tmp_path, name="again.yaml", max_steps=4, save_steps=1)
    _at_step(monkeypatch, 2, _fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        main(["train", again, "--overwrite"])
    unfinished = out / "incomplete-run"
    kept = _files(out)
    assert {k: v for k, v in kept.items() if not k.startswith("incomplete-run/")} == earlier
    assert (unfinished / "checkpoint-1" / "trainer_state.json").is_file()
    assert not (unfinished / "model").exists() and not (unfinished / "report.json").exists()

    monkeypatch.undo()
    assert main(["train", again, "--overwrite", "--resume-from-checkpoint"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 3 and report["losses"][0][0] == 2  # steps 2-4, after checkpoint-1
    assert report["saved_to"] == str(out / "model") and report["report_path"] == str(out / "report.json")
    assert report["memory_plot"] == str(out / "memory_timeline.png")
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint-1",
        "checkpoint-2",
        "checkpoint-3",
        "checkpoint-4",
        "memory_timeline.png",
        "model",
        "report.json",
        "report.md",
    ]
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert _files(out / "model") != {k[len("model/") :]: v for k, v in earlier.items() if k.startswith("model/")}
    transformers.AutoModelForCausalLM.from_pretrained(out / "model")


def test_overwrite_replaces_only_the_earlier_run(tmp_path):
    """Files of the user's own in output_dir stay; the LoRA adapter names its base where it ends up."""
    out = tmp_path / "out"
    lora = {"lora_rank": 4, "save_steps": 1}
    assert main(["train", _config(tmp_path, **lora)]) == 0
    (out / "notes.txt").write_text("mine")
    assert main(["train", _config(tmp_path, max_steps=1, **lora), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert not (out / "incomplete-run").exists() and not (out / "replaced-run").exists()
    assert json.loads((out / "report.json").read_text())["steps"] == 1
    for adapter in (out / "adapter", out / "checkpoint-1"):
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(out / "base"), adapter


def _ctrl_c():
    signal.raise_signal(signal.SIGINT)  # as a terminal's Ctrl-C: the run's handler takes it


def test_ctrl_c_saves_a_checkpoint_at_that_step_and_the_resumed_run_says_so(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    config = _config(tmp_path, max_steps=6)  # no save_steps: the interrupt's is the only checkpoint
    _at_step(monkeypatch, 2, _ctrl_c)
    assert main(["train", config]) == 130
    err = capsys.readouterr().err
    checkpoint = out / "checkpoint-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "model.safetensors").is_file()
    assert not (out / "model").exists() and not (out / "report.json").exists()
    assert f"offloadkit: interrupted at step 2 of 6; the last checkpoint is {checkpoint}: continue" in err, err

    monkeypatch.undo()
    assert main(["train", config, "--resume-from-checkpoint"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["resumed_from"] == {"step": 2, "checkpoint": str(checkpoint)}
    assert report["steps"] == 4 and report["losses"][0][0] == 3
    assert f"resumed  from step 2 ({checkpoint})" in capsys.readouterr().out


def test_second_ctrl_c_while_the_checkpoint_is_written_leaves_no_half_checkpoint(tmp_path, monkeypatch, capsys):
    save_model = transformers.Trainer.save_model

    def interrupted_mid_save(self, *args, **kwargs):
        save_model(self, *args, **kwargs)
        _ctrl_c()  # the second one: the optimizer state is not written yet

    monkeypatch.setattr(transformers.Trainer, "save_model", interrupted_mid_save)
    _at_step(monkeypatch, 2, _ctrl_c)
    assert main(["train", _config(tmp_path, max_steps=6)]) == 130
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    assert "interrupted at step 2 of 6; nothing was saved" in capsys.readouterr().err


def test_ctrl_c_of_an_overwrite_run_keeps_both_runs_and_the_resumed_one_replaces_the_earlier(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    assert main(["train", _config(tmp_path, save_steps=2)]) == 0
    earlier = _files(out)
    config = _config(tmp_path, name="again.yaml", max_steps=5)
    _at_step(monkeypatch, 3, _ctrl_c)
    assert main(["train", config, "--overwrite"]) == 130
    err = capsys.readouterr().err
    stopped = out / "incomplete-run" / "checkpoint-3"
    assert json.loads((stopped / "trainer_state.json").read_text())["global_step"] == 3
    assert {k: v for k, v in _files(out).items() if not k.startswith("incomplete-run/")} == earlier
    assert f"the earlier run in {out} is untouched; this run's last checkpoint is {stopped}" in err, err
    assert "--overwrite --resume-from-checkpoint" in err

    monkeypatch.undo()
    assert main(["train", config, "--overwrite", "--resume-from-checkpoint"]) == 0
    report = json.loads((out / "report.json").read_text())
    # The checkpoint it resumed from has moved in with the rest of the run.
    assert report["resumed_from"] == {"step": 3, "checkpoint": str(out / "checkpoint-3")}
    assert (out / "checkpoint-3").is_dir() and not (out / "checkpoint-2").exists()
    assert report["steps"] == 2 and not (out / "incomplete-run").exists()
