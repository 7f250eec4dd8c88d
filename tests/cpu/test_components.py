"""The features prepare() attaches are one record each (``offloadkit/components.py``), in the
documented apply order; prepare() builds them in that order, close() detaches them in reverse,
report() asks each handle. What the records build is checked against the handles, notes and
wiring prepare() has always made. ``docs/config.md`` is generated from the options classes'
docstrings: every config key documented there once, and the file current."""

import dataclasses
import os
import re
import warnings

import pytest
import torch

from offloadkit.checkpointing.apply import CheckpointedBlocks
from offloadkit.components import COMPONENTS
from offloadkit.compose import OffloadRuntime, _Handle, prepare
from offloadkit.config import COMPONENTS as OPTIONS
from offloadkit.config import OffloadConfig
from offloadkit.config_docs import config_docs, key_docs
from offloadkit.engine import OffloadActivations
from offloadkit.layers import LayerStreamer
from offloadkit.longctx import AttentionHeadGroups, ChunkedLossHandle, TiledMLPHandle
from offloadkit.options import Options
from offloadkit.storage import HostMemoryBudget
from offloadkit.testing import build_llama, randomize_lora_b, run_step
from offloadkit.testing.cpu_streaming import stream_layers_on_cpu
from offloadkit.transfer.timeline import StepTimeline

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
APPLY_ORDER = (
    "context_parallel",  # switches the attention function the others run through
    "chunked_loss",  # replaces the loss: the timeline's head hooks see it as the forward's tail
    "fused_lora",  # the adapted projections' forward, which the tiled projections then call
    "kernels",  # the norms' and gated MLPs' forwards, which the tiled MLP and norms then call
    "attention_kernel",  # the attention modules' SDPA backend, in their forward and recompute
    "tiled_mlp",  # wraps modules inside the blocks, before checkpointing wraps the blocks
    "head_groups",  # likewise, the attention modules
    "checkpointing",  # replaces the blocks' forwards before the timeline and the manager exist
    "host_budget",  # shared by the two that follow
    "activations",  # the manager, on the timeline made after checkpointing
    "layer_streaming",  # moves the weights the others wrapped; acts after the manager
    "embeddings",  # last: one weight no other feature wraps
)
# The components as docs/architecture.md's "Apply order" names them.
ARCHITECTURE_NAMES = {
    "context_parallel": "context parallelism",
    "chunked_loss": "chunked loss",
    "tiled_mlp": "tiled MLP",
    "head_groups": "attention head groups",
    "fused_lora": "fused LoRA",
    "kernels": "Liger's kernels",
    "attention_kernel": "attention kernel",
    "checkpointing": "checkpointing",
    "activations": "activation offloading",
    "layer_streaming": "layer streaming",
    "embeddings": "embedding offloading",
}
HANDLES = ("manager", "checkpointing", "streamer", "chunked_loss", "tiled_mlp", "head_groups")


def llama():
    torch.manual_seed(0)
    return build_llama("tiny", attn_implementation="sdpa").train()


def lora_llama():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(llama(), peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    return randomize_lora_b(model).train()


def batch():
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def built(runtime):
    """Each public handle's type name, None where absent."""
    return {name: type(getattr(runtime, name)).__name__ for name in HANDLES if getattr(runtime, name) is not None}


def wrapped(model):
    """Modules whose forward is replaced on the instance, and the hooks on the model."""
    return [n for n, m in model.named_modules() if "forward" in m.__dict__], sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()
    )


def prepared(model, config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime = prepare(model, config)
    return runtime, [str(w.message) for w in caught if "offloadkit" in str(w.message)]


# -- the registry --------------------------------------------------------------------------------


def test_the_registry_is_the_documented_apply_order():
    assert tuple(c.name for c in COMPONENTS) == APPLY_ORDER
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Apply order", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"\*\*(.+?)\*\*", section)
    positions = [named.index(ARCHITECTURE_NAMES[c.name]) for c in COMPONENTS if c.name in ARCHITECTURE_NAMES]
    assert positions == sorted(positions), named
    # The shared timeline is made by the first client that needs it, after checkpointing.
    assert named.index("checkpointing") < named.index("the step timeline") < named.index("activation offloading")


def test_each_record_states_its_options_and_one_line_reason():
    assert len({c.name for c in COMPONENTS}) == len(COMPONENTS)
    for component in COMPONENTS:
        assert issubclass(component.options, Options) and component.options.keys(), component.name
        why = component.why_here
        assert why and "\n" not in why and not why.endswith(".") and len(why) <= 110, component.name
        # Beside its code: in the folder of the feature, not in the registry.
        assert component.build.__module__.endswith(".component"), component.name
    attributes = {name: value for name, value in vars(OffloadRuntime).items() if isinstance(value, _Handle)}
    assert set(attributes) == set(HANDLES)
    assert {a.name for a in attributes.values()} <= {c.name for c in COMPONENTS}


# -- what prepare() builds -----------------------------------------------------------------------


def test_checkpointing_with_activation_offloading_on_a_cpu_machine_notes_the_missing_gpu():
    runtime, warned = prepared(llama(), {"gradient_checkpointing": True, "activation_offloading": True})
    assert built(runtime) == {"checkpointing": "CheckpointedBlocks"}
    assert runtime.timeline is None and isinstance(runtime.handles["host_budget"], HostMemoryBudget)
    note = (
        "activation_offloading: True has no effect without a CUDA GPU "
        "(use activation_offloading: disk to move CPU activations to disk)"
    )
    assert runtime.notes == [note] and warned == [f"offloadkit: {note}"]
    runtime.close()


def test_disk_mode_builds_the_manager_on_the_shared_timeline_and_keeps_the_last_block_input(tmp_path):
    model = llama()
    clean = wrapped(model)
    config = {"gradient_checkpointing": True, "activation_offloading": "disk", "disk_dir": str(tmp_path)}
    runtime, warned = prepared(model, config)
    assert built(runtime) == {"manager": "OffloadActivations", "checkpointing": "CheckpointedBlocks"}
    assert isinstance(runtime.manager, OffloadActivations) and isinstance(runtime.checkpointing, CheckpointedBlocks)
    assert warned == [] and runtime.notes == []
    assert isinstance(runtime.timeline, StepTimeline) and runtime.manager.timeline is runtime.timeline
    assert runtime.checkpointing._outer is runtime.manager  # the last block's inputs stay: needed first
    with runtime.context():
        loss = model(**batch()).loss
    loss.backward()
    report = runtime.report()
    assert list(report) == ["config", "notes", "prefetch", "activations", "storage"]
    assert report["storage"]["tier"] == runtime.manager.storage_stats()["tier"]
    runtime.close()
    assert wrapped(model) == clean and runtime.timeline is None
    assert all(h is None for h in runtime.handles.values())


def test_long_context_parts_build_their_handles_and_close_restores_the_model():
    model = llama()
    clean = wrapped(model)
    reference, _ = run_step(llama(), batch())
    config = {"chunked_cross_entropy": True, "tiled_mlp": True, "tiled_projections": True, "attention_head_groups": 2}
    runtime, warned = prepared(model, config)
    assert built(runtime) == {
        "chunked_loss": "ChunkedLossHandle",
        "tiled_mlp": "TiledMLPHandle",
        "head_groups": "AttentionHeadGroups",
    }
    assert isinstance(runtime.chunked_loss, ChunkedLossHandle) and isinstance(runtime.tiled_mlp, TiledMLPHandle)
    assert isinstance(runtime.head_groups, AttentionHeadGroups) and warned == []
    loss, _ = run_step(model, batch(), ctx=runtime.context())
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    assert runtime.head_groups.grouped_calls > 0
    runtime.close()
    assert wrapped(model) == clean


def test_layer_streaming_is_cuda_only_and_says_so_on_a_cpu_machine():
    runtime, warned = prepared(llama(), {"layer_offloading": True})
    assert built(runtime) == {} and runtime.timeline is None
    assert runtime.notes == ["layer_offloading has no effect without a CUDA GPU"]
    assert warned == ["offloadkit: layer_offloading has no effect without a CUDA GPU"]
    runtime.close()


def test_layer_streaming_loads_ahead_of_the_replays_of_the_checkpointing_before_it(monkeypatch):
    """Its CUDA-only build, run with CPU memory as the device."""
    import offloadkit.layers.component as streaming

    model = lora_llama()
    clean = wrapped(model)
    runtime, _ = prepared(model, {"gradient_checkpointing": True, "recompute_block_inputs": [1]})
    assert runtime.checkpointing._replay_hooks == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(streaming, "apply_layer_streaming", stream_layers_on_cpu)
    options = runtime.config.replace(layer_offloading=True).options(streaming.StreamingOptions)
    runtime.handles["layer_streaming"] = streaming.LAYER_STREAMING.build(model, options, runtime)
    monkeypatch.undo()
    assert isinstance(runtime.streamer, LayerStreamer) and runtime.streamer.timeline is runtime.timeline
    assert list(runtime.checkpointing._replay_hooks.values()) == [runtime.streamer.make_resident]
    run_step(model, batch(), ctx=runtime.context())
    assert runtime.report()["layer_streaming"]["loads"] > 0
    runtime.close()
    assert wrapped(model) == clean


def test_settings_for_offloadkits_checkpointing_are_noted_under_hugging_faces(tmp_path):
    model = lora_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = {
        "gradient_checkpointing": True,
        "selective_checkpointing": ["mm"],
        "keep_attention_outputs": True,
        "activation_offloading": "disk",
        "disk_dir": str(tmp_path),
    }
    runtime, _ = prepared(model, config)
    assert built(runtime) == {"manager": "OffloadActivations"}
    # (The config's own check first: the two keys together leave keeping nothing to do.)
    assert runtime.notes[0].startswith("keep_attention_outputs has no effect with selective_checkpointing")
    assert runtime.notes[1:] == [
        f"{key} has no effect: Hugging Face gradient checkpointing is already on (turn it off to use offloadkit's)"
        for key in ("selective_checkpointing", "keep_attention_outputs")
    ]
    runtime.close()


def test_gpu_block_inputs_without_offloading_is_noted_by_the_activations_build():
    runtime, warned = prepared(llama(), {"gradient_checkpointing": True, "gpu_block_inputs": 1})
    assert built(runtime) == {"checkpointing": "CheckpointedBlocks"}
    assert runtime.notes[-1].startswith("gpu_block_inputs has no effect: it keeps block inputs of offloadkit's")
    assert len(warned) == 2  # the config's own warning, then the build's note
    runtime.close()


def test_a_note_points_at_the_caller_of_prepare():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime = prepare(llama(), {"layer_offloading": True})
    (warning,) = [w for w in caught if "offloadkit" in str(w.message)]
    assert os.path.basename(warning.filename) == os.path.basename(__file__)
    runtime.close()


def test_close_detaches_in_reverse_apply_order_then_the_timeline(tmp_path):
    model = llama()
    config = {
        "chunked_cross_entropy": True,
        "tiled_mlp": True,
        "attention_head_groups": 2,
        "gradient_checkpointing": True,
        "activation_offloading": "disk",
        "disk_dir": str(tmp_path),
    }
    runtime, _ = prepared(model, config)
    order = []
    for name, handle in [*runtime.handles.items(), ("timeline", runtime.timeline)]:
        if handle is not None and name != "host_budget":  # (the budget has nothing to detach)
            method = "close" if name == "activations" else "remove"  # what each record calls
            original = getattr(handle, method)
            setattr(handle, method, lambda original=original, name=name: (order.append(name), original())[1])
    runtime.close()
    assert order == ["activations", "checkpointing", "head_groups", "tiled_mlp", "chunked_loss", "timeline"]


def test_a_handle_set_after_prepare_is_detached_by_close():
    """The Trainer route sets ``runtime.checkpointing`` when the Trainer left it off."""
    from offloadkit.checkpointing import apply_activation_checkpointing

    model = llama()
    clean = wrapped(model)
    runtime, _ = prepared(model, {})
    runtime.checkpointing = apply_activation_checkpointing(model)
    assert isinstance(runtime.handles["checkpointing"], CheckpointedBlocks)
    runtime.close()
    assert runtime.checkpointing is None and wrapped(model) == clean


# -- docs/config.md --------------------------------------------------------------------------------


def test_every_config_key_is_documented_by_exactly_one_options_field():
    documented = {}
    for cls in OPTIONS:
        docs = key_docs(cls)
        # Each field a key sets is documented with that key (``field: ``key``: text``), nothing else.
        assert {key: field for key, (field, _) in docs.items()} == cls.keys(), cls.__name__
        for key, (_, text) in docs.items():
            assert text.strip() and key not in documented, (cls.__name__, key)
            documented[key] = cls
    assert sorted(documented) == sorted(OffloadConfig.keys())


def test_key_docs_reads_each_keyed_field_of_the_attributes_section():
    @dataclasses.dataclass
    class Demo(Options):
        """Options of a demo.

        Attributes:
            size: ``demo_size``: how big, over
                two lines (a: b).
            internal: not a config key.

        Example:
            >>> Demo(size: ``not_this``: no)
        """

    assert key_docs(Demo) == {"demo_size": ("size", "how big, over two lines (a: b).")}

    class Twice(Options):
        """Two fields read from one key.

        Args:
            a: ``k``: one.
            b: ``k``: two.
        """

    with pytest.raises(ValueError, match="documents k twice"):
        key_docs(Twice)


def test_docs_config_md_is_current():
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        written = f.read()
    assert written == config_docs(), (
        "docs/config.md is stale: python -m offloadkit.config_docs --write-docs docs/config.md"
    )
    for key in OffloadConfig.keys():
        assert f"| `{key}` |" in written, key


def test_a_build_that_fails_detaches_what_the_builds_before_it_attached(monkeypatch):
    """A late component's build raising (here the activations', as a failed pinned allocation
    would) leaves the model as it was: the long-context parts built before it are removed."""
    model = llama()
    clean = wrapped(model)
    from offloadkit import compose

    def failing(model, options, run):
        raise RuntimeError("cannot pin memory")

    records = tuple(dataclasses.replace(c, build=failing) if c.name == "activations" else c for c in COMPONENTS)
    monkeypatch.setattr(compose, "COMPONENTS", records)
    with pytest.raises(RuntimeError, match="cannot pin memory"):
        prepared(model, {"chunked_cross_entropy": True, "tiled_mlp": True, "activation_offloading": True})
    assert wrapped(model) == clean
