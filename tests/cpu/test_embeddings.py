"""A frozen input embedding table in host memory (``embedding_offloading``), the feature added
as one folder and one registry line: its key is the registry's (no field in ``config.py``),
``prepare()`` builds it in its place or says why it cannot take effect, the planner counts
its footprint from the options the run sets, and a plan keeps them. (On CUDA:
``tests/gpu/test_embeddings_cuda.py``.)"""

import os
import warnings

import pytest

from offloadkit.compose import component_options, prepare
from offloadkit.config import ConfigError, ConfigProblemsError, OffloadConfig
from offloadkit.embeddings import EmbeddingOptions
from offloadkit.planning import Budgets, Parallelism, plan
from offloadkit.planning.plan import option
from offloadkit.testing import build_llama

peft = pytest.importorskip("peft")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUDGETS = Budgets(79 << 30, 200 << 30, 100 << 30)


def _lora(tied=False):
    model = build_llama("tiny", tie_word_embeddings=tied)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))


def test_its_key_is_the_registrys_and_spelled_only_in_its_folder():
    config = OffloadConfig.from_dict({"embedding_offloading": True})
    assert config.embedding_offloading is True and OffloadConfig().embedding_offloading is False
    assert config.to_dict()["embedding_offloading"] is True
    assert config.replace(embedding_offloading=False).embedding_offloading is False
    assert config.options(EmbeddingOptions).offload is True
    with pytest.raises(ConfigError, match=r"embedding_offloading=3 has the wrong type"):
        OffloadConfig.from_dict({"embedding_offloading": 3})
    with pytest.raises(ConfigProblemsError, match="did you mean 'embedding_offloading'"):
        OffloadConfig.from_dict({"embeding_offloading": True})
    with pytest.raises(AttributeError):
        OffloadConfig().no_such_key  # noqa: B018
    spelled = []
    for folder, _, files in os.walk(os.path.join(ROOT, "offloadkit")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    if "embedding_offloading" in f.read():
                        spelled.append(os.path.relpath(os.path.join(folder, name), ROOT))
    assert spelled and all(path.startswith("offloadkit/embeddings/") for path in spelled), spelled
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        assert "| `embedding_offloading` | `EmbeddingOptions`" in f.read()


@pytest.mark.parametrize(
    "case, reason",
    [
        ("cpu", "the table is on cpu, not on a GPU"),
        ("tied", "tied embeddings"),
        ("trains", "the input embedding table trains"),
    ],
)
def test_prepare_says_why_it_cannot_take_effect(case, reason):
    model = _lora(tied=case == "tied") if case != "trains" else build_llama("tiny")
    with pytest.warns(UserWarning, match=f"embedding_offloading has no effect: .*{reason}"):
        runtime = prepare(model, {"embedding_offloading": True})
    assert runtime.handles.get("embeddings") is None
    assert "embedding_offloading" not in runtime.report()
    runtime.close()


def test_off_by_default_nothing_is_built():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime = prepare(_lora(), {})
    assert not [w for w in caught if "offloadkit" in str(w.message)]
    assert runtime.handles.get("embeddings") is None
    runtime.close()


def test_the_planner_counts_its_footprint_and_the_plan_keeps_it():
    on = (EmbeddingOptions(offload=True),)
    without = plan("llama-3-8b", 65536, budgets=BUDGETS)
    with_it = plan("llama-3-8b", 65536, budgets=BUDGETS, options=on)
    table = 128256 * 4096 * 2
    assert with_it.name == without.name
    assert without.memory.gpu_peak - with_it.memory.gpu_peak == table
    assert with_it.memory.gpu_parts["input embeddings in host memory"] == -table
    assert with_it.memory.host - without.memory.host == table
    assert with_it.memory.host_parts["input embeddings"] == table
    config = with_it.to_config()
    assert config["embedding_offloading"] is True and "embedding_offloading" not in without.to_config()
    assert OffloadConfig.from_dict(config).embedding_offloading is True
    # Nothing to take off: a full fine-tune's table trains, a tied one is the head's.
    full = plan("llama-3-8b", 16384, lora_rank=0, budgets=BUDGETS, options=on)
    assert full.memory.gpu_peak == plan("llama-3-8b", 16384, lora_rank=0, budgets=BUDGETS).memory.gpu_peak
    tied = plan("llama-3.2-1b", 65536, budgets=BUDGETS, options=on)
    assert tied.memory.gpu_peak == plan("llama-3.2-1b", 65536, budgets=BUDGETS).memory.gpu_peak
    fsdp = Parallelism(world_size=2, shard_weights=True, ranks_per_host=2)
    sharded = plan("llama-3-8b", 16384, budgets=BUDGETS, parallel=fsdp, options=on)
    assert sharded.memory.gpu_peak == plan("llama-3-8b", 16384, budgets=BUDGETS, parallel=fsdp).memory.gpu_peak


def test_prepare_hands_the_planner_every_components_options():
    config = OffloadConfig.from_dict({"embedding_offloading": True, "chunked_cross_entropy": True})
    options = component_options(config)
    assert EmbeddingOptions(offload=True) in options
    assert len({type(o) for o in options}) == len(options)
    planned = plan("llama-3-8b", 65536, budgets=BUDGETS, options=options)
    assert option(planned.options, EmbeddingOptions).offload is True


def test_a_longer_sequence_fits_with_the_table_off_the_gpu():
    from offloadkit.planning.capacity import longest_sequence

    budgets = Budgets(20 << 30, 200 << 30, 100 << 30)
    plain = longest_sequence("llama-3-8b", budgets=budgets).longest
    offloaded = longest_sequence("llama-3-8b", budgets=budgets, options=(EmbeddingOptions(offload=True),)).longest
    assert offloaded > plain


def test_the_block_inputs_ram_share_is_sized_beside_the_table():
    """The table's pinned host bytes come off the RAM the planner gives block inputs: a larger
    host budget never turns a plan that fits into one that does not."""
    options = (EmbeddingOptions(offload=True),)
    fits = []
    for quarter in range(60, 70):  # 15.0 to 17.25 GiB
        p = plan("llama-3-8b", 65536, budgets=Budgets(18 << 30, quarter << 28, 500 << 30), options=options)
        fits.append(p.fits)
        assert "input embeddings" in p.memory.host_parts
    assert all(fits), fits


def test_the_plan_counts_the_table_where_the_build_would_leave_it():
    """``offload_plan: auto`` plans the table off the GPU only where the build takes it off:
    not for a table that trains (PEFT's modules_to_save), nor on a CPU."""
    from offloadkit.compose import plan_for

    trained = peft.get_peft_model(
        build_llama("tiny"), peft.LoraConfig(r=4, target_modules="all-linear", modules_to_save=["embed_tokens"])
    )
    for model in (trained, _lora()):
        config = OffloadConfig.from_dict({"offload_plan": "auto", "seq_len": 256, "embedding_offloading": True})
        assert component_options(config, model)[-1] == EmbeddingOptions(offload=False)
        planned = plan_for(model, config, None, None)
        assert option(planned.options, EmbeddingOptions).offload is False
        assert "input embeddings in host memory" not in planned.memory.gpu_parts


def test_a_config_equals_itself_through_its_keys_and_takes_the_key_by_assignment():
    assert OffloadConfig.from_dict(OffloadConfig().to_dict()) == OffloadConfig()
    assert OffloadConfig.from_dict({"embedding_offloading": False}) == OffloadConfig()
    assert OffloadConfig.from_dict({"embedding_offloading": True}) != OffloadConfig()
    config = OffloadConfig()
    config.embedding_offloading = True
    assert config.replace(gradient_checkpointing=True).embedding_offloading is True
    assert "embedding_offloading=True" in repr(config)
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        OffloadConfig(_extra={"bogus": 1})


def test_its_key_goes_through_the_constructor_replace_and_a_shallow_copy_as_a_fields_does():
    import copy
    import dataclasses

    config = OffloadConfig(embedding_offloading=True, tiled_mlp=True)
    assert config.embedding_offloading is True and config == OffloadConfig.from_dict(
        {"embedding_offloading": True, "tiled_mlp": True}
    )
    assert dataclasses.replace(config, embedding_offloading=False).embedding_offloading is False
    copied = copy.copy(config)
    copied.embedding_offloading = False
    assert config.embedding_offloading is True  # the copy's registered keys are its own
    with pytest.raises(TypeError, match="bogus"):
        OffloadConfig(bogus=1)
