"""Axolotl's ``early_stopping_patience``: the run stops once the evaluation loss has not improved
for that many evaluations, ending with the best checkpoint's weights; refused, as Axolotl
refuses it, without a held-out set or without save_steps a multiple of eval_steps."""

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("yaml")

from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigProblemsError  # noqa: E402
from tests.cpu.test_axolotl_keys import _axolotl, _run  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401


def test_training_stops_when_the_evaluation_loss_stops_improving(tmp_path, monkeypatch):
    # A learning rate far too high: the evaluation loss worsens from the first evaluations on.
    config = _axolotl(
        tmp_path,
        val_set_size=8,
        eval_steps=1,
        save_steps=2,
        early_stopping_patience=2,
        max_steps=12,
        learning_rate=0.5,
        optimizer="sgd",
        max_grad_norm=0,
    )
    seen, report = _run(tmp_path, monkeypatch, config)
    assert seen.args.load_best_model_at_end and seen.args.metric_for_best_model == "eval_loss"
    losses = [e["eval_loss"] for e in report["evaluations"]]
    assert report["steps"] < 12  # stopped early
    best = min(range(len(losses)), key=losses.__getitem__)
    assert len(losses) - 1 - best >= 2  # two evaluations without improving on the best


@pytest.mark.parametrize(
    "keys, match",
    [
        ({"val_set_size": 0}, r"early_stopping_patience=3 stops on the evaluation loss: it needs a held-out set"),
        ({"evals_per_epoch": 4, "saves_per_epoch": 1}, r"early_stopping_patience=3 needs save_steps and eval_steps"),
        ({"eval_steps": 3, "save_steps": 4}, r"needs save_steps=4 to be a multiple of eval_steps=3"),
    ],
)
def test_early_stopping_without_what_it_needs_is_refused(tmp_path, keys, match):
    config = _axolotl(tmp_path, **{"val_set_size": 0.1, "early_stopping_patience": 3, **keys})
    with pytest.raises(ConfigProblemsError, match=match):
        TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False)
