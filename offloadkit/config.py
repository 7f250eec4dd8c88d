"""The offloading configuration: one typed dataclass, with YAML/JSON/dict loaders on top.

Keys follow the names users already know (``gradient_checkpointing``,
``activation_offloading: true | legacy | disk``, ``layer_offloading``,
``activation_loading_horizon``); SageMaker's ``sm_activation_offloading`` is accepted as an
alias. Wrong types and impossible combinations raise :class:`ConfigError` naming the key,
the value and the fix; unknown keys, one short line naming them (the first few), any close
match and where the keys are listed. Settings that cannot take effect produce one warning each.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, TypeVar

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.components import COMPONENTS as REGISTRY
from offloadkit.engine.options import ActivationOptions
from offloadkit.errors import ConfigError, ConfigProblemsError, UnsupportedError
from offloadkit.layers.options import StreamingOptions
from offloadkit.longctx.options import LongContextOptions
from offloadkit.lora.options import LoraOptions
from offloadkit.optim.options import OptimizerOptions
from offloadkit.options import Options
from offloadkit.parallel.options import ParallelOptions
from offloadkit.planning.options import PlanOptions
from offloadkit.storage.disk import DiskOptions
from offloadkit.storage.options import BudgetOptions
from offloadkit.transfer.options import TransferOptions

__all__ = [
    "ConfigError",
    "ConfigProblemsError",
    "UnsupportedError",
    "OffloadConfig",
    "parse_bytes",
    "load_mapping",
    "check_keys",
    "check_writable_dir",
    "unknown_keys",
    "KEYS_HELP",
]

ALIASES = {"sm_activation_offloading": "activation_offloading"}
# The components whose options the config keys set, each key owned by exactly one: these, then
# any registered component's (offloadkit.components) not among them.
_DECLARED: tuple[type[Options], ...] = (
    CheckpointOptions,
    ActivationOptions,
    TransferOptions,
    BudgetOptions,
    DiskOptions,
    StreamingOptions,
    OptimizerOptions,
    LongContextOptions,
    LoraOptions,
    ParallelOptions,
    PlanOptions,
)
COMPONENTS: tuple[type[Options], ...] = _DECLARED + tuple(
    dict.fromkeys(c.options for c in REGISTRY if c.options not in _DECLARED)
)

OptionsT = TypeVar("OptionsT", bound=Options)
_OWNER = {key: (cls, name) for cls in COMPONENTS for key, name in cls.keys().items()}


def _default(key: str) -> Any:
    """The default of config key ``key``: its component's (stated there, not here)."""
    cls, name = _OWNER[key]
    return cls.default(name)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: Any, key: str) -> int | None:
    """``16GiB``, ``512MB``, ``1e9`` or an int -> bytes (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is not a size; give bytes (e.g. 17179869184) or a string like '16GiB'")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{key}={value!r} is not a size; give bytes or a string like '16GiB' or '512MB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"{key}={value!r} must be positive; omit it for no cap")
    return n


def load_mapping(path: str) -> dict:
    """Read a YAML (.yaml/.yml) or JSON file into a dict, with one-line errors."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
    else:
        from offloadkit.extras import MissingExtraError, require

        try:
            yaml = require("yaml", "yaml", f"reading {os.path.basename(path)}")
        except MissingExtraError as exc:
            raise ConfigError(f"{exc} (or give the config as .json)") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, got {type(data).__name__}")
    return data


# Where a user finds every key; the messages name it rather than list 100+ keys.
KEYS_HELP = "see offloadkit train --help for the keys"


def _shown(key: Any, width: int = 40) -> str:
    text = repr(key)
    return text if len(text) <= width else text[: width - 4] + "...'"


def unknown_keys(keys: list, known: Iterable[str], cutoff: float = 0.75, width: int = 110) -> str:
    """``unknown key 'x' (did you mean 'y'?)``, or for several ``3 unknown keys: ...``: those with
    a close match in ``known`` first, as many as fit in about ``width`` characters, then how
    many more. The caller adds the fix (e.g. :data:`KEYS_HELP`)."""
    candidates = sorted({str(k) for k in known})
    described = []
    for key in keys:
        close = difflib.get_close_matches(str(key), candidates, n=1, cutoff=cutoff)
        described.append((not close, f"{_shown(key)} (did you mean {close[0]!r}?)" if close else _shown(key)))
    parts = [text for _, text in sorted(described, key=lambda item: item[0])]  # close matches first (stable)
    if len(parts) == 1:
        return f"unknown key {parts[0]}"
    shown = parts[:1]
    for part in parts[1:]:
        if len(", ".join(shown + [part])) > width:
            break
        shown.append(part)
    more = f" and {len(parts) - len(shown)} more" if len(shown) < len(parts) else ""
    return f"{len(parts)} unknown keys: {', '.join(shown)}{more}"


def check_keys(data: dict, known: list[str], source: str) -> dict:
    """Apply aliases and reject unknown keys, all in one line: each with a close match, if any."""
    out = {}
    unknown = []
    for key, value in data.items():
        key = ALIASES.get(key, key)
        if key not in known:
            unknown.append(key)
            continue
        out[key] = value
    if unknown:
        raise ConfigProblemsError(source, [(f"{unknown_keys(unknown, known)}; {KEYS_HELP}", False)])
    return out


def check_writable_dir(path: str, key: str, fix: str) -> str:
    """Create ``path`` if missing and prove a file can be written in it.

    Args:
        path: the directory.
        key: the config key, for the message.
        fix: what to do instead, for the message.

    Returns:
        The path.

    Raises:
        ConfigError: ``path`` is a file, or cannot be created or written.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} is a file, not a directory; {fix}")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".offloadkit-probe-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"{key}={path!r} cannot be written ({exc.strerror or exc}); {fix}") from None
    return path


@dataclass
class OffloadConfig:
    """What to offload and how. Every field has a sensible default; all off by default.

    Each key sets one component's options (:data:`COMPONENTS`), documented there, beside the
    component's code. ``docs/config.md`` lists every key with its component, default and
    documentation (``python -m offloadkit.config_docs --write-docs docs/config.md`` writes it).

    Example:
        >>> OffloadConfig.from_dict({"gradient_checkpointing": True, "activation_offloading": True})
    """

    gradient_checkpointing: bool = _default("gradient_checkpointing")
    selective_checkpointing: list[str] | None = _default("selective_checkpointing")
    activation_offloading: bool | str = _default("activation_offloading")
    activation_loading_horizon: int | None = _default("activation_loading_horizon")
    prefetch_bytes: int | None = _default("prefetch_bytes")
    prefetch_window_bytes: int | None = _default("prefetch_window_bytes")
    min_offload_size: int = _default("min_offload_size")
    max_fwd_stash_size: int = _default("max_fwd_stash_size")
    gpu_block_inputs: int = _default("gpu_block_inputs")
    recompute_block_inputs: tuple[int, ...] = _default("recompute_block_inputs")
    block_input_placement: tuple[str, ...] = _default("block_input_placement")
    keep_attention_outputs: bool | int = _default("keep_attention_outputs")
    use_pin_memory: bool = _default("use_pin_memory")
    host_budget_bytes: int | None = _default("host_budget_bytes")
    host_min_free_bytes: int | None = _default("host_min_free_bytes")
    gpu_budget_bytes: int | None = _default("gpu_budget_bytes")
    disk_dir: str | None = _default("disk_dir")
    disk_threads: int = _default("disk_threads")
    direct_io: bool | str = _default("direct_io")
    disk_tiering: bool = _default("disk_tiering")
    layer_offloading: bool = _default("layer_offloading")
    optimizer_offloading: bool = _default("optimizer_offloading")
    optimizer_precision: str = _default("optimizer_precision")
    optimizer_state_dir: str | None = _default("optimizer_state_dir")
    layer_offloading_depth: int = _default("layer_offloading_depth")
    layer_offloading_dir: str | None = _default("layer_offloading_dir")
    chunked_cross_entropy: bool = _default("chunked_cross_entropy")
    chunked_cross_entropy_num_chunks: int | None = _default("chunked_cross_entropy_num_chunks")
    tiled_mlp: bool = _default("tiled_mlp")
    tiled_mlp_num_shards: int | None = _default("tiled_mlp_num_shards")
    tiled_projections: bool = _default("tiled_projections")
    attention_head_groups: int | None = _default("attention_head_groups")
    fused_lora: bool | list[str] | None = _default("fused_lora")
    context_parallel: bool = _default("context_parallel")
    context_parallel_rotation: str = _default("context_parallel_rotation")
    offload_plan: str = _default("offload_plan")
    seq_len: int | None = _default("seq_len")
    batch_size: int = _default("batch_size")
    _warnings: list[str] = field(default_factory=list, repr=False, compare=False)
    # The keys of registered components that have no field above (a feature added to the
    # registry needs no line here): every one of them, at its value or its default; set by
    # from_dict, replace or assignment, read as attributes.
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        unknown = sorted(set(self._extra) - set(_EXTRA_OWNER))
        if unknown:
            raise ConfigError(f"{unknown_keys(unknown, self.keys())}; {KEYS_HELP}")
        self._extra = {key: self._extra.get(key, cls.default(name)) for key, (cls, name) in _EXTRA_OWNER.items()}

    def __getattr__(self, name: str) -> Any:
        # Only for names no field has: a registered component's key reads as its value or default.
        owner = _EXTRA_OWNER.get(name)
        if owner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        extra = self.__dict__.get("_extra", {})
        return extra[name] if name in extra else owner[0].default(owner[1])

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXTRA_OWNER:
            self._extra[name] = value
        else:
            super().__setattr__(name, value)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.keys())
        return f"{type(self).__name__}({shown})"

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if not f.name.startswith("_")] + list(_EXTRA_OWNER)

    @classmethod
    def _split(cls, data: dict) -> tuple[dict, dict]:
        """``data`` as (keys with a field, keys of registered components without one)."""
        return {k: v for k, v in data.items() if k not in _EXTRA_OWNER}, {
            k: v for k, v in data.items() if k in _EXTRA_OWNER
        }

    @classmethod
    def from_dict(cls, data: dict | None, source: str = "config") -> "OffloadConfig":
        data = check_keys(dict(data or {}), cls.keys(), source)
        for key in ("host_budget_bytes", "host_min_free_bytes", "gpu_budget_bytes"):
            if key in data:
                data[key] = parse_bytes(data[key], key)
        for key in ("prefetch_bytes", "prefetch_window_bytes"):
            if data.get(key) is not None:
                data[key] = parse_bytes(data[key], key)
        if isinstance(data.get("activation_offloading"), str) and data["activation_offloading"].lower() in (
            "true",
            "false",
        ):
            data["activation_offloading"] = data["activation_offloading"].lower() == "true"
        if data.get("tiled_mlp_num_shards") == "auto":
            data["tiled_mlp_num_shards"] = None
        declared, extra = cls._split(data)
        config = cls(**declared, _extra=extra)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str) -> "OffloadConfig":
        return cls.from_dict(load_mapping(path), source=path)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.keys()}

    def validate(self) -> "OffloadConfig":
        """Check types and combinations (ConfigError); collect can't-take-effect warnings.

        Each key's own checks are its component's (its options dataclass raises naming the
        key); the checks here are of keys of different components together."""
        for key in ("recompute_block_inputs", "block_input_placement"):
            if isinstance(getattr(self, key), list):
                setattr(self, key, tuple(getattr(self, key)))  # YAML gives a list
        for cls in COMPONENTS:
            try:
                cls.from_config(self)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        places = self.block_input_placement
        if "disk" in places and self.activation_offloading != "disk":
            raise ConfigError(
                f"block_input_placement puts inputs on disk but activation_offloading={self.activation_offloading!r}; "
                "set activation_offloading: disk (with disk_tiering: true to keep the others in RAM)"
            )
        if self.disk_tiering and self.host_budget_bytes is None and "disk" not in places:
            # (With a placement that names the disk, the place of each block input is given.)
            raise ConfigError(
                "disk_tiering: true needs host_budget_bytes (the RAM share before spilling to disk), "
                "e.g. host_budget_bytes: 16GiB"
            )
        if self.fused_lora and "mm" in (self.selective_checkpointing or ()):
            raise ConfigError(
                f"selective_checkpointing={self.selective_checkpointing!r} saves matmul outputs, and fused_lora "
                f"(={self.fused_lora!r}) adds each adapter's output into its base projection's output in place, "
                "which selective checkpointing's saved copy refuses in backward; set fused_lora: false, or save only "
                "[attention]"
            )
        self._warnings = []
        if self.optimizer_precision != "params" and not self.optimizer_offloading:
            self._warn(
                "optimizer_precision only applies with optimizer_offloading: true; the Trainer's own optimizer runs"
            )
        if self.optimizer_state_dir is not None and not self.optimizer_offloading:
            self._warn(
                "optimizer_state_dir only applies with optimizer_offloading: true; the Trainer's own optimizer "
                "keeps its state on the GPU"
            )
        if self.keep_attention_outputs and not (self.gradient_checkpointing and self.activation_offloading):
            self._warn(
                "keep_attention_outputs needs gradient_checkpointing: true and activation_offloading (the outputs "
                "wait in the block-input storage); it has no effect"
            )
        elif self.keep_attention_outputs and self.selective_checkpointing:
            self._warn(
                "keep_attention_outputs has no effect with selective_checkpointing: its recompute replays the "
                "outputs selective checkpointing saved (save [attention] to skip the attention forward again)"
            )
        if self.recompute_block_inputs and not self.gradient_checkpointing:
            self._warn("recompute_block_inputs needs gradient_checkpointing: true; it has no effect")
        if places:
            if "ram" in places and self.activation_offloading == "disk" and not self.disk_tiering:
                self._warn("block_input_placement puts inputs in ram, but without disk_tiering: true they go to disk")
            if not self.gradient_checkpointing:
                self._warn("block_input_placement needs gradient_checkpointing: true; it has no effect")
        if (
            self.prefetch_window_bytes
            and self.offload_plan != "auto"  # the plan may turn them on
            and not (self.activation_offloading or self.layer_offloading or self.optimizer_offloading)
        ):
            self._warn(
                "prefetch_window_bytes bounds what activation_offloading, layer_offloading and "
                "optimizer_offloading fetch ahead; none is on, so it has no effect"
            )
        if self.layer_offloading_dir is not None and not self.layer_offloading:
            self._warn("layer_offloading_dir only applies with layer_offloading: true; it has no effect")
        for key, on in (
            ("chunked_cross_entropy_num_chunks", "chunked_cross_entropy"),
            ("tiled_mlp_num_shards", "tiled_mlp"),
        ):
            if getattr(self, key) is not None and not getattr(self, on):
                self._warn(f"{key} only applies with {on}: true; it has no effect")
        disk_keys = [k for k in ("disk_dir", "disk_threads", "direct_io") if getattr(self, k) != _default(k)]
        if disk_keys and self.activation_offloading != "disk":
            self._warn(f"{', '.join(disk_keys)} only apply with activation_offloading: disk; they have no effect")
        if self.activation_offloading is False:
            changed = [
                k
                for k in ("activation_loading_horizon", "min_offload_size", "max_fwd_stash_size", "gpu_block_inputs")
                if getattr(self, k) != _default(k)
            ]
            if changed:
                self._warn(f"{', '.join(changed)} only apply with activation_offloading on; they have no effect")
        return self

    def options(self, component: type[OptionsT]) -> OptionsT:
        """``component``'s options as this config sets them.

        Example:
            >>> OffloadConfig(layer_offloading=True).options(StreamingOptions).depth
            2
        """
        return component.from_config(self)

    def check_paths(self) -> None:
        """Machine-dependent checks, run before anything loads: the disk tier's directory
        (or the system temp directory it defaults to) must be a writable directory."""
        if self.activation_offloading == "disk":
            where = self.disk_dir if self.disk_dir is not None else tempfile.gettempdir()
            key = "disk_dir" if self.disk_dir is not None else "disk_dir (default: the temp directory)"
            check_writable_dir(
                where, key, "give a writable directory for offloaded activations (it is created if missing)"
            )
        if self.layer_offloading and self.layer_offloading_dir is not None:
            check_writable_dir(
                self.layer_offloading_dir,
                "layer_offloading_dir",
                "give a writable directory for streamed weights past the host budget (it is created if missing)",
            )

    def _warn(self, message: str) -> None:
        self._warnings.append(message)
        warnings.warn(f"offloadkit: {message}", UserWarning, stacklevel=4)

    def replace(self, **changes) -> "OffloadConfig":
        declared, extra = self._split(changes)
        return dataclasses.replace(self, **declared, _extra={**self._extra, **extra}).validate()


# Keys of registered components' options that have no field of their own above.
_FIELDS = {f.name for f in fields(OffloadConfig)}
_EXTRA_OWNER = {key: owner for key, owner in _OWNER.items() if key not in _FIELDS}
_fields_init = OffloadConfig.__init__


def _init(self, *args, _extra: dict | None = None, **kwargs) -> None:
    # A registered component's key by keyword, as a field's: in the constructor and in
    # dataclasses.replace (which calls the constructor).
    declared, extra = OffloadConfig._split(kwargs)
    _fields_init(self, *args, **declared, _extra={**(_extra or {}), **extra})  # type: ignore[misc]  # declared never holds _extra


def _copy(self) -> "OffloadConfig":
    # A shallow copy owns its registered keys: assigning one on the copy leaves the original.
    out = object.__new__(type(self))
    out.__dict__.update(self.__dict__, _extra=dict(self._extra), _warnings=list(self._warnings))
    return out


OffloadConfig.__init__ = _init  # type: ignore[method-assign]
OffloadConfig.__copy__ = _copy  # type: ignore[attr-defined]
