"""Axolotl's LISA (``lisa_n_layers``, ``lisa_step_interval``, ``lisa_layers_attribute``): every
interval, only that many decoder layers drawn at random train, the rest of the model always."""

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("yaml")

import offloadkit.cli.train as train_module  # noqa: E402
from offloadkit.cli.train import run_train  # noqa: E402
from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigError, ConfigProblemsError  # noqa: E402
from tests.cpu.test_axolotl_keys import _axolotl, _run  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401

FULL = dict(adapter=None, lora_r=..., lora_alpha=..., lora_target_linear=...)


def test_only_the_sampled_layers_train(tmp_path, monkeypatch):
    config = _axolotl(tmp_path, lisa_n_layers=1, lisa_step_interval=2, max_steps=6, **FULL)
    changed = []

    def probe(model):
        # A copy of every decoder layer's weights before training, compared after each step.
        return [{k: v.detach().clone() for k, v in layer.state_dict().items()} for layer in model.model.layers]

    class Watch(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            before = self.before
            now = [{k: v.detach().clone() for k, v in layer.state_dict().items()} for layer in model.model.layers]
            changed.append(
                [any(not torch.equal(b[k], n[k]) for k in b) for b, n in zip(before, now)]  # type: ignore[union-attr]
            )
            self.before = now

    watch = Watch()
    quiet = train_module._quiet

    def with_watch(trainer):
        watch.before = probe(trainer.model)
        trainer.add_callback(watch)
        return quiet(trainer)

    monkeypatch.setattr(train_module, "_quiet", with_watch)
    report = run_train(TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False), log=lambda *a: None)
    assert report["steps"] == 6
    assert all(sum(step) == 1 for step in changed)  # one of the two layers trained at each step
    # Redrawn at steps 1, 2 and 4 (of steps 0-5): within an interval the same layer trains.
    assert changed[2] == changed[3] and changed[4] == changed[5]


def test_lisa_it_cannot_run_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ConfigProblemsError, match="lisa_n_layers=1 samples the layers of a full fine-tune"):
        TrainConfig.from_dict(
            _axolotl(tmp_path, lisa_n_layers=1, lisa_step_interval=2), source="axolotl.yaml", cuda=False
        )
    with pytest.raises(ConfigError, match="lisa_n_layers=3 is more than the model's 2 layers"):
        _run(tmp_path / "deep", monkeypatch, _axolotl(tmp_path / "deep", lisa_n_layers=3, lisa_step_interval=2, **FULL))
