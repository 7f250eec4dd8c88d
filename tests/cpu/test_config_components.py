"""Each component owns its options (a dataclass beside it, with its defaults, documentation and
checks); ``OffloadConfig`` maps the YAML keys onto them and restates no default."""

import dataclasses

import pytest

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.config import COMPONENTS, ConfigError, OffloadConfig
from offloadkit.engine.options import ActivationOptions
from offloadkit.layers.options import StreamingOptions
from offloadkit.longctx.options import LongContextOptions
from offloadkit.optim.options import OptimizerOptions
from offloadkit.storage import DiskOptions


def test_every_key_has_exactly_one_owner_and_its_default():
    owned = [key for cls in COMPONENTS for key in cls.keys()]
    assert len(owned) == len(set(owned)), "a key set by two components"
    assert set(owned) == set(OffloadConfig.keys())
    config = OffloadConfig()
    for cls in COMPONENTS:
        for key, name in cls.keys().items():
            assert getattr(config, key) == cls.default(name), key
        for f in dataclasses.fields(cls):
            assert f.name in cls.__doc__, f"{cls.__name__}.{f.name} is not documented"


def test_a_config_gives_each_component_its_options():
    config = OffloadConfig.from_dict(
        {
            "gradient_checkpointing": True,
            "activation_offloading": "disk",
            "disk_tiering": True,
            "host_budget_bytes": "1GiB",
            "disk_dir": "/tmp/spill",
            "disk_threads": 2,
            "activation_loading_horizon": 3,
            "layer_offloading": True,
            "layer_offloading_depth": 3,
            "tiled_mlp": True,
            "tiled_mlp_num_shards": 8,
            "recompute_block_inputs": [2, 3],
        }
    )
    acts = config.options(ActivationOptions)
    assert (acts.mode, acts.storage, acts.loading_horizon) == ("disk", "tiered", 3)
    disk = config.options(DiskOptions)
    assert (disk.directory, disk.threads, disk.direct_io) == ("/tmp/spill", 2, "auto")
    assert config.options(StreamingOptions) == StreamingOptions(enabled=True, depth=3)
    assert config.options(CheckpointOptions).recompute_block_inputs == (2, 3)
    assert config.options(LongContextOptions).mlp_shards == 8
    assert config.options(OptimizerOptions) == OptimizerOptions()


@pytest.mark.parametrize(
    "component, kwargs, message",
    [
        (CheckpointOptions, {"block_input_placement": ("recompute", "gpu")}, "layer 0's input cannot be recomputed"),
    ],
)
def test_a_component_names_the_config_key_in_its_errors(component, kwargs, message):
    with pytest.raises(ValueError, match=message):
        component(**kwargs)
    key = next(k for k, n in component.keys().items() if n == next(iter(kwargs)))
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict({key: next(iter(kwargs.values()))})


@pytest.mark.parametrize(
    "component, field, value, message",
    [
        (DiskOptions, "directory", 123, "=123 is invalid; pass a path"),
        (DiskOptions, "threads", 0, "=0 is invalid; pass an int >= 1"),
        (StreamingOptions, "depth", 0, "=0 is too small"),
        (StreamingOptions, "disk_dir", 5, "=5 has the wrong type"),
        (ActivationOptions, "loading_horizon", -1, "=-1 is too small"),
        (LongContextOptions, "mlp_shards", "many", "='many' has the wrong type"),
        (OptimizerOptions, "enabled", "yes", "='yes' has the wrong type"),
        (ActivationOptions, "mode", "sometimes", "='sometimes' is not a mode"),
        (ActivationOptions, "mode", 1, "=1 is not a mode"),
        (OptimizerOptions, "precision", "fp8", "='fp8' is not a precision"),
    ],
)
def test_an_error_names_the_setting_as_the_caller_wrote_it(component, field, value, message):
    """Python code passed the field (``DiskOptions(directory=123)``); a config, the key (``disk_dir``)."""
    key = component().key(field)
    assert key != field
    for source in ("python", "config", "python again"):  # the config's naming ends with it
        with pytest.raises(ValueError) as err:
            if source == "config":
                OffloadConfig.from_dict({key: value})
            else:
                component(**{field: value})
        expected = f"{key if source == 'config' else field}{message}"
        assert str(err.value).startswith(expected), (source, str(err.value))
    assert isinstance(err.value, ValueError) and not isinstance(err.value, ConfigError)


@pytest.mark.parametrize(
    "data, named, close",
    [
        ({"activation_offlaoding": True}, "'activation_offlaoding'", "did you mean 'activation_offloading'?"),
        ({"volumes": [{"name": "data", "mount": "/workspace/data"}] * 50}, "unknown key 'volumes'", None),
        (
            {k: 1 for k in ("gpu", "gpu_count", "memory", "timeout", "memory_preprocess", "timeout_preprocess")}
            | {"project_name": "x" * 500, "branch": None, "secrets": ["HF_TOKEN"] * 200, "dockerfile_commands": None},
            "10 unknown keys: 'gpu', 'gpu_count',",
            None,
        ),
        (
            {"a" * 300: 1, "gradient_checkpoint": True, "b": 2},
            "3 unknown keys: 'gradient_checkpoint' (did you mean 'gradient_checkpointing'?)",
            None,
        ),
    ],
    ids=["close match", "no close match", "many keys", "long key"],
)
def test_unknown_keys_are_one_short_line_with_the_fix(data, named, close):
    """Named (the first few, and how many), with a close match if any, and where the keys are
    listed: not every key offloadkit knows, nor the values."""
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_dict(data, source="modal.yaml")
    message = str(err.value)
    assert len(message) <= 200 and "\n" not in message, (len(message), message)
    assert named in message and "offloadkit train --help" in message
    assert close is None or close in message
    assert "host_budget_bytes" not in message  # no list of the known keys


def test_keys_of_different_components_are_checked_together():
    with pytest.raises(ConfigError, match="disk_tiering: true needs host_budget_bytes"):
        OffloadConfig.from_dict({"activation_offloading": "disk", "disk_tiering": True})
    with pytest.raises(ConfigError, match="puts inputs on disk but activation_offloading=True"):
        OffloadConfig.from_dict(
            {"gradient_checkpointing": True, "activation_offloading": True, "block_input_placement": ["disk", "gpu"]}
        )
    with pytest.warns(UserWarning, match="layer_offloading_depth only|min_offload_size only apply"):
        OffloadConfig.from_dict({"min_offload_size": 0})


def test_a_rule_between_two_settings_is_said_as_the_caller_wrote_them():
    """A config reads YAML (``key: true``); Python code, its keyword arguments."""
    with pytest.raises(ValueError, match=r"^tiled_projections=True needs tiled_mlp=True \(") as err:
        LongContextOptions(tiled_projections=True)
    assert not isinstance(err.value, ConfigError)
    with pytest.raises(ConfigError, match=r"^tiled_projections: true needs tiled_mlp: true \("):
        OffloadConfig.from_dict({"tiled_projections": True})
    with pytest.raises(ValueError, match=r"^disk_tiering=True needs mode='disk'"):
        ActivationOptions(disk_tiering=True)
    with pytest.raises(ConfigError, match=r"^disk_tiering: true needs activation_offloading: disk"):
        OffloadConfig.from_dict({"disk_tiering": True, "activation_offloading": True})
