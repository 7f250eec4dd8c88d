"""Axolotl's learning-rate schedule keys: ``lr_quadratic_warmup`` (the cosine schedule with its
warmup factor squared) and ``cosine_constant_lr_ratio: 0`` (which Axolotl's scheduler reads as
unset); a non-zero ratio is still refused."""

import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("yaml")

from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigProblemsError  # noqa: E402
from tests.cpu.test_axolotl_keys import _axolotl, _run  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401


def test_lr_quadratic_warmup_squares_the_warmup_then_decays_by_cosine(tmp_path, monkeypatch):
    config = _axolotl(
        tmp_path, lr_scheduler="cosine", lr_quadratic_warmup=True, warmup_steps=4, max_steps=10, learning_rate=1e-3
    )
    seen, _ = _run(tmp_path, monkeypatch, config)
    expected = [1e-3 * (k / 4) ** 2 for k in range(1, 4)]
    expected += [1e-3 * 0.5 * (1 + math.cos(math.pi * (k - 4) / 6)) for k in range(4, 11)]
    assert seen.lrs == pytest.approx(expected, abs=1e-12)


def test_lr_quadratic_warmup_needs_the_cosine_schedule(tmp_path):
    config = _axolotl(tmp_path, lr_scheduler="linear", lr_quadratic_warmup=True)
    with pytest.raises(ConfigProblemsError, match="lr_quadratic_warmup=True shapes the cosine schedule's warmup"):
        TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False)


def test_cosine_constant_lr_ratio_zero_is_the_schedule_without_it(tmp_path, monkeypatch):
    keys = dict(lr_scheduler="cosine", cosine_min_lr_ratio=1.0, warmup_steps=2, max_steps=4)
    with_zero, _ = _run(tmp_path / "a", monkeypatch, _axolotl(tmp_path / "a", cosine_constant_lr_ratio=0, **keys))
    without, _ = _run(tmp_path / "b", monkeypatch, _axolotl(tmp_path / "b", **keys))
    # Warmup, then cosine_min_lr_ratio 1.0 holds the learning rate (Axolotl's 3B QAT recipes).
    assert with_zero.lrs == without.lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])
    with pytest.raises(ConfigProblemsError, match=r"cosine_constant_lr_ratio=0.8: Axolotl's cosine schedule"):
        TrainConfig.from_dict(_axolotl(tmp_path / "c", cosine_constant_lr_ratio=0.8), source="a.yaml", cuda=False)
