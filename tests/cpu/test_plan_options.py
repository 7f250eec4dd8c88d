"""A plan is a set of components' options: ``Plan.options`` holds what it chose as each
component's options object, ``Plan.to_config`` writes them through their own config keys, and
those options alone predict the plan's own bytes and step time."""

from __future__ import annotations

import warnings

import pytest

from offloadkit.checkpointing.footprint import keeps_attention
from offloadkit.component import FootprintOptions, OptionSet
from offloadkit.components import COMPONENTS
from offloadkit.config import OffloadConfig
from offloadkit.embeddings.options import EmbeddingOptions
from offloadkit.layers.options import StreamingOptions
from offloadkit.longctx.options import LongContextOptions
from offloadkit.optim.footprint import optimizer_footprint
from offloadkit.parallel.footprint import sharded_weights_footprint
from offloadkit.planning import Budgets, estimate_memory, plan
from offloadkit.planning.memory import PLANNED_OPTIONS, footprints, long_context_counts, long_context_options
from offloadkit.planning.parallelism import Parallelism
from offloadkit.planning.plan import changed_fields, option, planned_options
from offloadkit.planning.planner import OptimizerSetup
from offloadkit.planning.timing import estimate_time

GiB = 1 << 30

# Budgets that make the planner keep block inputs on the GPU, in RAM, on disk, nowhere
# (recomputed), keep attention outputs, stream weights, move a full fine-tune's state and
# choose a ring rotation.
CASES = [
    ("llama-3-8b", 16384, 16, Budgets(79 * GiB, 100 * GiB, 60 * GiB), {}),
    ("llama-3-8b", 131072, 16, Budgets(79 * GiB, 100 * GiB, 60 * GiB), {"fused_lora": True}),
    ("llama-3-8b", 524288, 16, Budgets(40 * GiB, 8 * GiB, 200 * GiB), {}),
    ("llama-3-8b", 524288, 16, Budgets(22 * GiB, 30 * GiB, 500 * GiB), {}),
    ("llama-3-8b", 1048576, 16, Budgets(139 * GiB, 400 * GiB, 1000 * GiB), {}),
    ("llama-3-8b", 131072, 0, Budgets(22 * GiB, 30 * GiB, 500 * GiB), {"optimizer_precision": "compact"}),
    (
        "llama-3-8b",
        16384,
        0,
        Budgets(40 * GiB, 200 * GiB, 200 * GiB),
        {"optimizer": OptimizerSetup(updates_in_backward=True)},
    ),
    (
        "llama-3-8b",
        524288,
        16,
        Budgets(79 * GiB, 100 * GiB, 60 * GiB),
        {"parallel": Parallelism(world_size=4, context_parallel=True)},
    ),
    ("llama-3.2-3b", 1048576, 16, Budgets(79 * GiB, 100 * GiB, 60 * GiB), {}),
    ("tiny", 512, 16, Budgets(8 * GiB, 8 * GiB, 8 * GiB), {"options": (EmbeddingOptions(offload=True),)}),
]


def _plans():
    for model, seq, rank, budgets, kwargs in CASES:
        p = plan(model, seq, lora_rank=rank, budgets=budgets, **kwargs)
        yield p
        yield p.at_depth(3)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_a_plans_options_as_a_footprint_reads_them_predict_its_bytes_and_time(index):
    model, seq, rank, budgets, kwargs = CASES[index]
    p = plan(model, seq, lora_rank=rank, budgets=budgets, **kwargs)
    for q in (p, p.at_depth(3)):
        f = OptionSet(q.options)
        m = estimate_memory(q.workload, f)
        assert m == q.memory, q.name
        assert estimate_time(q.workload, f, q.budgets.rates, m.block_placement) == q.time, q.name


def test_the_planners_choices_cover_recomputed_tiered_and_kept_inputs():
    places = {where for p in _plans() for where in p.placement}
    assert places == {"gpu", "ram", "disk", "recompute"}
    assert any(keeps_attention(p.workload, OptionSet(p.options)) for p in _plans())


def test_to_config_writes_each_options_fields_and_a_config_reads_the_same_options_back():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # settings without effect at these toy depths
        for p in _plans():
            keys: dict = {}
            for o in p.options:
                keys |= type(o).config_keys(**changed_fields(o))
            assert keys == p.to_config()
            config = OffloadConfig.from_dict(p.to_config())
            for o in p.options:
                assert config.options(type(o)) == o, (p.name, o)


def test_a_plan_chooses_every_planned_components_options_and_passes_the_others_through():
    p = plan("tiny", 512, budgets=Budgets(8 * GiB, 8 * GiB, 8 * GiB), options=(EmbeddingOptions(offload=True),))
    assert [type(o) for o in p.options] == [*PLANNED_OPTIONS, EmbeddingOptions]
    assert p.to_config()["embedding_offloading"] is True
    # What the plan decides is written even at its default: it overrides the run's own keys.
    assert p.to_config()["layer_offloading"] is False and p.to_config()["activation_offloading"] is False


def test_a_plans_long_context_options_are_those_its_resolved_counts_build():
    for p in _plans():
        long = option(p.options, LongContextOptions)
        assert long_context_options(*long_context_counts(long)) == long, p.name
        assert not long.chunked_loss or long.loss_chunks, p.name  # never automatic
        assert not long.tiled_mlp or long.mlp_shards, p.name


def test_a_candidates_choice_stands_over_a_planned_components_options_the_run_passes():
    w = next(_plans()).workload
    given = (LongContextOptions(chunked_loss=False), EmbeddingOptions())
    c = planned_options(w, loss_chunks=8, mlp_shards=4, others=given)
    assert option(c, LongContextOptions) == LongContextOptions(
        chunked_loss=True, loss_chunks=8, tiled_mlp=True, mlp_shards=4
    )
    assert option(c, EmbeddingOptions) is given[1]
    assert option(c, StreamingOptions) == StreamingOptions(enabled=False)


class _ProtocolOnly:
    """Options seen only through :class:`FootprintOptions`: reading anything else fails."""

    def __init__(self, options) -> None:
        self._options = options
        self._names = {n for n in dir(FootprintOptions) if not n.startswith("_")}

    def __getattr__(self, name: str):
        if name not in self._names:
            raise AttributeError(f"a footprint read {name!r}, which FootprintOptions does not have")
        return getattr(self._options, name)


def test_footprints_read_the_options_only_through_their_protocol():
    for p in _plans():
        options = OptionSet(p.options)
        for c in COMPONENTS:
            if c.footprint is not None:
                assert c.footprint(p.workload, _ProtocolOnly(options)) == c.footprint(p.workload, options)
        for fp in (optimizer_footprint, sharded_weights_footprint):
            assert fp(p.workload, _ProtocolOnly(options)) == fp(p.workload, options)


def test_each_footprint_given_only_the_workload_and_the_plans_options_is_the_plans_own():
    """What each component spends follows from the workload and the options a plan writes:
    no count the planner keeps beside them (the footprints are called with the options alone,
    and the plan's estimate is their sum)."""
    for p in _plans():
        options = OptionSet(p.options)
        summed = dict(footprints(p.workload, options))
        assert summed == dict(footprints(p.workload, p.options)), p.name
        for c in COMPONENTS:
            if c.footprint is not None:
                assert c.footprint(p.workload, options) == summed[c.name], (p.name, c.name)
        assert optimizer_footprint(p.workload, options) == summed["optimizer"]
        assert sharded_weights_footprint(p.workload, options) == summed["sharded weights"]
        assert estimate_memory(p.workload, p.options) == p.memory, p.name
        assert estimate_time(p.workload, p.options, p.budgets.rates, p.placement) == p.time, p.name


def test_the_options_a_plans_config_sets_predict_the_plans_bytes_and_time():
    """The planner's search space is its components' options: a plan's options, written as
    config keys and read back by :class:`OffloadConfig`, are the same options and predict the
    same step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # settings without effect at these toy depths
        for p in _plans():
            config = OffloadConfig.from_dict(p.to_config())
            read = tuple(config.options(type(o)) for o in p.options)
            assert read == p.options, p.name
            m = estimate_memory(p.workload, read)
            assert m == p.memory, p.name
            assert estimate_time(p.workload, read, p.budgets.rates, m.block_placement) == p.time, p.name


def test_the_planners_candidates_are_components_options():
    """Every candidate the search realises is a tuple of options (the planned components' in
    order, then the run's), and a plan built from its options alone is the same plan."""
    from offloadkit.options import Options
    from offloadkit.planning.plan import Plan
    from offloadkit.planning.planner import _candidates

    for model, seq, rank, budgets, kwargs in CASES:
        p = plan(model, seq, lora_rank=rank, budgets=budgets, **kwargs)
        w = p.workload
        given = tuple(kwargs.get("options", ()))
        for name, c in _candidates(w, budgets, 2, True, given):
            assert all(isinstance(o, Options) for o in c), name
            assert [type(o) for o in c] == [*PLANNED_OPTIONS, *(type(o) for o in given)], name
        again = Plan(w, p.options, p.budgets, p.name, p.memory, p.time, p.fits, optimizer=p.optimizer)
        assert again.options == p.options and again.to_config() == p.to_config()


def test_at_depth_places_what_the_gpu_no_longer_holds_within_the_host_budget():
    """A full plan whose GPU holds every block input: at fewer layers an input leaves the GPU
    and goes where the host budget has room (here disk, RAM having none), as the planner
    counted it; a plan keeping attention outputs of its layers keeps no more at more layers."""
    from offloadkit.planning import Budgets, plan

    gib = 1 << 30
    full = plan("llama-3-8b", 32768, lora_rank=0, budgets=Budgets(40 * gib, 6 * gib, 30 * gib))
    assert full.placement.count("gpu") == len(full.placement)
    short = full.at_depth(2)
    assert short.placement == ["disk", "gpu"] and short.to_config()["activation_offloading"] == "disk"
    six = plan("llama-3-8b", 131072, budgets=Budgets(79 * gib, 100 * gib, 60 * gib), layers=6)
    kept = six.to_config().get("keep_attention_outputs")
    assert kept in (True, 6), kept
    assert six.at_depth(8).to_config().get("keep_attention_outputs") == 6
