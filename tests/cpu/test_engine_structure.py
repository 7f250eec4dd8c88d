"""The engine's layout: the manager owns its forward path, backward path and the lifetime of
entries as separate objects over one explicit state, and its attributes read and write that
state (a value set on the manager is the one the paths use)."""

import os

import torch

from offloadkit import OffloadActivations
from offloadkit.engine.backward import BackwardPath
from offloadkit.engine.forward import ForwardPath
from offloadkit.engine.lifetime import Lifetime
from offloadkit.engine.stats import OffloadStats

ENGINE = os.path.join(os.path.dirname(__file__), "..", "..", "offloadkit", "engine")
MAX_LINES = 500


def _step(manager, model, x):
    with manager:
        loss = model(x).sum()
    loss.backward()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


def test_no_engine_module_is_over_500_lines():
    for name in sorted(os.listdir(ENGINE)):
        if name.endswith(".py"):
            with open(os.path.join(ENGINE, name), encoding="utf-8") as f:
                lines = sum(1 for _ in f)
            assert lines < MAX_LINES, f"engine/{name} has {lines} lines: split it by responsibility"


def test_the_paths_are_collaborators_over_one_state():
    assert not issubclass(OffloadActivations, (ForwardPath, BackwardPath, Lifetime))
    manager = OffloadActivations(offload_cpu_tensors=True)
    try:
        shared = manager._shared
        assert manager._forward.shared is shared and manager._backward.shared is shared
        assert manager._lifetime.shared is shared
        assert manager._forward.lifetime is manager._lifetime is manager._backward.lifetime
    finally:
        manager.close()


def test_the_managers_attributes_are_the_state_the_paths_use():
    model, x = _model(), torch.randn(8, 64, requires_grad=True)
    manager = OffloadActivations(offload_cpu_tensors=True, min_offload_size=0, prefetch=2)
    try:
        _step(manager, model, x)
        first = manager.collect_stats()
        assert first.offloaded_tensors > 0 and first.prefetch_hits > 0
        manager.reset_stats()
        assert manager.stats is not first and manager._shared.stats is manager.stats
        manager.prefetch = 0  # no look-ahead: every entry is fetched when backward needs it
        assert manager._shared.prefetch == 0
        _step(manager, model, x)
        stats = manager.collect_stats()
        assert isinstance(stats, OffloadStats) and stats.offloaded_tensors == first.offloaded_tensors
        assert stats.prefetch_hits == 0 and stats.prefetch_misses == stats.offloaded_tensors
        assert manager.tensor_id == 2 * first.saved_tensors
        manager.drain()
        assert manager.is_idle() and not manager._entries and not manager._passes
    finally:
        manager.close()
