"""``offloadkit check CONFIG [CONFIG...]``: validate configs without training.

Everything ``offloadkit train`` checks before it loads a model: the keys and their values
(offloadkit's or an Axolotl config's, through the same :class:`TrainConfig` validation), the
dataset files (exist, readable, UTF-8, a format and type offloadkit reads, not empty), the
model (a local Hugging Face directory with a readable config.json of a causal LM, or a
built-in shape; a hub id is looked up in the local Hugging Face cache), output_dir and the
disk directories, the resume checkpoint, and with ``offload_plan: auto`` (or ``--plan``)
whether the planner finds a plan within the budgets. Nothing is created, downloaded,
tokenised or loaded.

Each problem is one line ``CONFIG: key: problem; fix``, then one verdict line per config
(``CONFIG: ok`` or ``CONFIG: N problems``); the exit status is 0 when every config is ok.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import warnings

__all__ = ["add_check_parser", "run_check", "check_config"]

_GiB = 1 << 30
_WIDTH = 200  # characters of one problem line, at most
# Optimizers the Trainer always has: no need to import transformers to know them.
_PLAIN_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "adagrad", "rmsprop")
# Dataset files past this size are checked over their first bytes only (UTF-8, not empty).
_READ_WHOLE = 64 << 20


def add_check_parser(sub) -> argparse.ArgumentParser:
    """Register ``check`` on the ``offloadkit`` subcommand parser."""
    p = sub.add_parser(
        "check",
        help="validate config files without training (keys, dataset, model, output_dir, plan)",
        description="Check configs as offloadkit train would before training, without loading or "
        "downloading anything: one line per problem (CONFIG: key: problem; fix), then a verdict per "
        "config. Exit status 0 when every config is ok, 1 otherwise.",
    )
    p.add_argument("configs", nargs="+", metavar="CONFIG", help="YAML or JSON config files (offloadkit or Axolotl)")
    p.add_argument("--output-dir", help="check as if train were given --output-dir")
    p.add_argument("--overwrite", action="store_true", help="check as if train were given --overwrite")
    p.add_argument(
        "--drop-unsupported-keys",
        action="store_true",
        help="check as if train were given --drop-unsupported-keys",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="also check that the planner finds a plan within the budgets (always done with offload_plan: auto)",
    )
    p.add_argument("--gpu-gib", type=float, default=None, help="GPU budget for the plan (default: this GPU's)")
    p.add_argument("--host-gib", type=float, default=None, help="host RAM budget for the plan (default: available)")
    p.add_argument("--disk-gib", type=float, default=None, help="disk budget for the plan (default: free space)")
    return p


def _line(source: str, key: str, message: str) -> str:
    """``source: key: problem; fix`` in about :data:`_WIDTH` characters: a long problem is
    shortened, the fix is kept whole where it can be."""
    head = f"{source}: {key}: "
    message = " ".join(message.split())
    if len(head) + len(message) <= _WIDTH:
        return head + message
    problem, sep, fix = message.partition("; ")
    room = max(_WIDTH - len(head), 150)  # a long config path does not squeeze out the problem
    keep = min(len(problem), max(room - len(sep) - len(fix), room * 3 // 5))
    if keep < len(problem):
        problem = problem[: keep - 3] + "..."
    text = problem + sep + fix
    return head + (text if len(text) <= room else text[: room - 3] + "...")


_KEY = re.compile(r"^([A-Za-z_][\w.\[\]]*)(?:=|: | )")


def _split(message: str, source: str) -> tuple[str, str]:
    """A validation message as ``(key, the rest)``: the messages start with ``key=value ...``."""
    message = " ".join(message.split())
    for prefix in (f"{source}: ", "preflight: ", "datasets: "):
        if message.startswith(prefix):
            message = message[len(prefix) :]
    if re.match(r"^(\d+ )?unknown keys?\b", message):
        return "keys", message
    m = _KEY.match(message)
    if m:
        return m.group(1), message
    return "config", message


class _Problems:
    """The problem lines of one config, each once."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.items: list[tuple[str, str]] = []
        self.notes: list[str] = []  # what is not a problem but worth saying in the verdict

    def add(self, key: str, message: str) -> None:
        item = (key, " ".join(message.split()))
        if item not in self.items:
            self.items.append(item)

    def add_error(self, exc: Exception) -> None:
        from offloadkit.config import ConfigProblemsError

        messages = [m for m, _ in exc.problems] if isinstance(exc, ConfigProblemsError) else [str(exc)]
        for message in messages:
            self.add(*_split(message, self.source))

    def lines(self) -> list[str]:
        return [_line(self.source, key, message) for key, message in self.items]


def _offending(message: str, data: dict) -> list:
    """The config keys a validation message is about (to drop them and validate the rest)."""
    found = [k for k in data if re.match(rf"^{re.escape(str(k))}(=|\b)", message)]
    found += [k for k in data if k not in found and (f"'{k}'" in message and "unknown key" in message)]
    return found


def _load_train_config(data: dict, source: str, problems: _Problems):
    """The :class:`TrainConfig` as train reads it; on a problem, report it, drop the keys it
    names and validate the rest again, so that every problem is found. Returns the config
    of the keys that validate (None when none could be read)."""
    from offloadkit.cli.train_config import TrainConfig
    from offloadkit.config import ALIASES, ConfigError, OffloadConfig
    from offloadkit.integrations import axolotl

    data = dict(data)
    if not axolotl.looks_like_axolotl(data):
        known = TrainConfig.train_keys() + OffloadConfig.keys()
        unknown = [k for k in data if ALIASES.get(k, k) not in known]
        if unknown:
            try:
                TrainConfig.from_dict(data, source=source)
            except ConfigError as exc:
                problems.add_error(exc)
            data = {k: v for k, v in data.items() if k not in unknown}
    for _ in range(len(data) + 2):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return TrainConfig.from_dict(data, source=source)
        except ConfigError as exc:
            problems.add_error(exc)
            messages = [m for m, _ in getattr(exc, "problems", [(str(exc), False)])]
            drop = {k for m in messages for k in _offending(_split(m, source)[1], data)}
            if not drop:
                return None
            data = {k: v for k, v in data.items() if k not in drop}
    return None


def _writable(path: str) -> str | None:
    """Why a directory could not be created or written at ``path`` (None: it could); creates nothing."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "is a file, not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is a file"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be created: {parent} is not writable"


def _check_output_dir(cfg, problems: _Problems) -> None:
    from offloadkit.cli.preflight import previous_run

    key = cfg.name("output_dir")
    why = _writable(cfg.output_dir)
    if why:
        problems.add(key, f"{key}={cfg.output_dir!r} {why}; choose a writable directory, e.g. --output-dir ./out")
        return
    if cfg.resume_from_checkpoint or cfg.overwrite_output_dir:
        return
    found = previous_run(cfg.output_dir)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        problems.add(
            key,
            f"{key}={cfg.output_dir!r} holds an earlier run ({shown}); choose another output_dir, or replace it "
            "with --overwrite (overwrite_output_dir: true)",
        )


def _check_disk_dirs(cfg, problems: _Problems) -> None:
    off = cfg.offload
    dirs = []
    if off.activation_offloading == "disk" and off.disk_dir is not None:
        dirs.append(("disk_dir", off.disk_dir))
    if off.layer_offloading and off.layer_offloading_dir is not None:
        dirs.append(("layer_offloading_dir", off.layer_offloading_dir))
    if off.optimizer_offloading and off.optimizer_state_dir is not None:
        dirs.append(("optimizer_state_dir", off.optimizer_state_dir))
    for key, path in dirs:
        why = _writable(path)
        if why:
            problems.add(key, f"{key}={path!r} {why}; give a writable directory (it is created if missing)")


def _causal_lm(config: dict) -> str | None:
    """Why a config.json is not a causal LM offloadkit train can load (None: it is)."""
    architectures = config.get("architectures") or []
    if any(isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures):
        return None
    model_type = config.get("model_type")
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    what = f"architectures {architectures}" if architectures else f"model_type {model_type!r}"
    return f"is not a causal language model transformers knows ({what}); give a decoder-only LM (Llama, Qwen2, ...)"


def _check_model(cfg, problems: _Problems) -> None:
    from offloadkit.cli.preflight import TOKENIZER_FILES

    if cfg.model is None:
        return  # the built-in shape is checked with the keys
    key = cfg.name("model")
    if not os.path.isdir(cfg.model):
        from offloadkit.integrations import hub

        if not hub.looks_like_hub_id(cfg.model):
            problems.add(
                key,
                f"{key}={cfg.model!r} is not a directory; give a local Hugging Face model directory or a hub id "
                "(org/name), or omit it for the built-in model",
            )
            return
        snapshot = hub.cached_snapshot(cfg.model, cfg.model_revision)
        if snapshot is None:
            if hub.offline():
                problems.add(
                    key,
                    f"{key}={cfg.model!r} is not in the local Hugging Face cache ({hub.hub_cache()}) and "
                    "HF_HUB_OFFLINE is set; set HF_HOME (or HF_HUB_CACHE) to a cache that has it, or unset "
                    "HF_HUB_OFFLINE",
                )
            else:
                problems.notes.append(f"{key} {cfg.model} is not in the local cache: train downloads it")
            return
        cfg.model = snapshot  # train reads the cached snapshot: check it as train will
    path = os.path.join(cfg.model, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        problems.add(key, f"{key}={cfg.model!r} has no config.json; give a directory written by save_pretrained(...)")
        return
    except (OSError, ValueError) as exc:
        problems.add(key, f"{key}={cfg.model!r}: config.json cannot be read ({' '.join(str(exc).split())[:80]})")
        return
    why = _causal_lm(config)
    if why is None:
        from offloadkit.planning import resolve_shape

        try:
            resolve_shape(cfg.model)
        except (ValueError, TypeError) as exc:
            why = f"has a config the planner cannot read ({exc})"
    if why:
        problems.add(key, f"{key}={cfg.model!r} {why}")
    tokenizer = cfg.tokenizer or cfg.model
    if not os.path.isdir(tokenizer) or not any(os.path.isfile(os.path.join(tokenizer, f)) for f in TOKENIZER_FILES):
        tkey = cfg.name("tokenizer") if cfg.tokenizer else key
        problems.add(
            tkey,
            f"{tkey}={tokenizer!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save one there "
            "with tokenizer.save_pretrained(...), or set tokenizer: DIR",
        )


def _check_contents(path: str, kind: str, text_field: str | None) -> str | None:
    """Why a dataset file cannot be read as ``kind`` (None: it can): empty, not UTF-8, not
    JSON, no text. Nothing is tokenised; a large file is checked over its first bytes."""
    from offloadkit.data.text import load_texts, not_utf8

    size = os.path.getsize(path)
    if size == 0:
        return "is empty; give a file with text"
    if size > _READ_WHOLE:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(head) - 4:  # not a character cut at the end of the read
                return str(not_utf8(path)).split(": ", 1)[1]
        return None
    try:
        if kind == "completion":
            load_texts(path, text_field or "text")
            return None
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        return str(not_utf8(path)).split(": ", 1)[1]
    except ValueError as exc:
        message = str(exc)
        return message.split(": ", 1)[1] if message.startswith(path) else message
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not text.strip():
        return "has no text"
    try:
        json.loads(text)
    except json.JSONDecodeError:
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as exc:
                    return f"line {number} is not valid JSON ({exc.msg}); give JSON Lines or a JSON array"
    return None


def _check_data(cfg, problems: _Problems) -> None:
    from offloadkit.cli import preflight

    for check in (preflight._dataset, preflight._datasets):
        try:
            check(cfg)
        except Exception as exc:  # ConfigError, or one the checks did not foresee
            problems.add_error(exc)
    if cfg.datasets:
        specs = [
            (f"{cfg.name('datasets')}[{i}].path", s.path, s.type, s.field) for i, s in enumerate(cfg.dataset_specs())
        ]
    elif cfg.dataset is not None:
        specs = [(cfg.name("dataset"), cfg.dataset, "completion", cfg.text_field)]
    else:
        specs = []
    from offloadkit.data.sft import DatasetSpec, check_path

    for key, path, kind, field in specs:
        if check_path(DatasetSpec(path=path, type=kind)) is not None:
            continue  # already reported
        why = _check_contents(path, kind, field)
        if why:
            problems.add(key, f"{key}={path!r} {why}")


def _check_packages(cfg, problems: _Problems) -> None:
    from offloadkit.cli import preflight

    reporters = [cfg.report_to] if isinstance(cfg.report_to, str) else list(cfg.report_to)
    if cfg.optimizer in _PLAIN_OPTIMIZERS and all(r == "none" for r in reporters) and not cfg.load_in_4bit:
        import importlib.util

        if cfg.lora_rank and importlib.util.find_spec("peft") is None:
            problems.add(cfg.name("lora_rank"), f"{cfg.name('lora_rank')}={cfg.lora_rank} needs PEFT: pip install peft")
        return
    try:
        preflight._packages(cfg)
    except Exception as exc:
        problems.add_error(exc)


def _check_resume(cfg, problems: _Problems) -> None:
    from offloadkit.cli import preflight

    try:
        preflight._resume(cfg)
    except Exception as exc:
        problems.add_error(exc)


def _check_adapter(cfg, problems: _Problems) -> None:
    """lora_model_dir: a saved adapter (a hub id is looked up in the cache, as the model is)."""
    from offloadkit.cli import preflight
    from offloadkit.integrations import hub

    if cfg.lora_model_dir is None:
        return
    if not os.path.isdir(cfg.lora_model_dir) and hub.looks_like_hub_id(cfg.lora_model_dir):
        found = hub.cached_snapshot(cfg.lora_model_dir)
        if found is None:
            if hub.offline():
                key = cfg.name("lora_model_dir")
                problems.add(
                    key,
                    f"{key}={cfg.lora_model_dir!r} is not in the local Hugging Face cache ({hub.hub_cache()}) and "
                    "HF_HUB_OFFLINE is set; set HF_HOME (or HF_HUB_CACHE) to a cache that has it",
                )
            return
        cfg.lora_model_dir = found
    try:
        preflight._adapter_dir(cfg)
    except Exception as exc:
        problems.add_error(exc)


def _names_embeddings(names) -> bool:
    return any("embed" in str(n) or str(n) in ("wte", "tok_embeddings") for n in (names or ()))


def _fuses_every_lora_layer(cfg) -> bool:
    """What the run's ``lora.fused.unfusable_reason`` will say of the model as configured
    (no model is loaded here): 16-bit weights (``auto`` counts as bf16: the run's GPU), plain
    LoRA on linear layers only."""
    targets = cfg.lora_target_modules if isinstance(cfg.lora_target_modules, list) else ()
    return (
        bool(cfg.lora_rank)
        and cfg.dtype in ("bfloat16", "float16", "auto")
        and not (
            cfg.load_in_4bit
            or cfg.load_in_8bit
            or cfg.lora_use_dora
            or cfg.lora_fan_in_fan_out
            or cfg.model_quantization_config
            or cfg.lora_target_parameters  # experts' parameters: LoRA layers of another kind
            or _names_embeddings(targets)  # a LoRA embedding layer
        )
    )


def _options_as_built(cfg, off, shape) -> tuple:
    """The components' options as they will take effect on the model as configured (what the
    build would refuse, off): the input embedding table stays on the GPU where it trains (a full
    fine-tune, ``lora_modules_to_save``) or the head shares it."""
    from offloadkit.compose import component_options
    from offloadkit.embeddings import EmbeddingOptions

    trains = not cfg.lora_rank or _names_embeddings(cfg.lora_modules_to_save)
    return tuple(
        EmbeddingOptions(offload=False)
        if isinstance(o, EmbeddingOptions) and o.offload and (trains or shape.tied)
        else o
        for o in component_options(off)
    )


def _check_plan(cfg, args, problems: _Problems) -> str | None:
    """Whether the planner fits the run within the budgets; returns a note for the verdict."""

    from offloadkit.planning import Budgets, OptimizerSetup, plan, resolve_shape

    off = cfg.offload

    def gib(value: float | None, name: str, fallback: int | None) -> int | None:
        if value is None:
            return fallback
        if value <= 0:
            raise ValueError(f"--{name}={value!r} must be positive")
        return int(value * _GiB)

    try:
        shape = resolve_shape(cfg.model if cfg.model is not None else cfg.model_shape)
    except (ValueError, TypeError, OSError) as exc:
        problems.add("offload_plan", f"the planner cannot read the model's shape ({exc})")
        return None
    host = gib(args.host_gib, "host-gib", None)
    budgets = Budgets.detect(
        gpu_bytes=gib(args.gpu_gib, "gpu-gib", off.gpu_budget_bytes),
        host_bytes=host,
        disk_bytes=gib(args.disk_gib, "disk-gib", None),
        disk_dir=off.disk_dir,
        # host_budget_bytes caps one rank, as the run applies it: not shared out again.
        host_bytes_per_rank=off.host_budget_bytes if host is None else None,
    )
    clipping = bool(cfg.max_grad_norm)
    chosen = plan(
        shape,
        cfg.seq_len,
        batch=cfg.batch_size,
        lora_rank=cfg.lora_rank or 0,
        budgets=budgets,
        dtype_bytes=4 if cfg.dtype == "float32" else 2,
        stream_depth=off.layer_offloading_depth,
        optimizer_precision=off.optimizer_precision,
        optimizer=OptimizerSetup(updates_in_backward=not clipping, source=f"max_grad_norm={cfg.max_grad_norm}"),
        fused_lora=off.fused_lora is True or (off.fused_lora is None and _fuses_every_lora_layer(cfg)),
        options=_options_as_built(cfg, off, shape),
    )
    m, b = chosen.memory, chosen.budgets
    if not chosen.fits:
        problems.add(
            "offload_plan",
            f"no plan fits {cfg.seq_len} tokens x {cfg.batch_size}: {', '.join(chosen.reasons)}; lower seq_len "
            "(offloadkit plan shows the longest that fits) or raise the budgets",
        )
        return None
    return (
        f"plan fits: {chosen.name}, GPU {m.gpu_reserved / _GiB:.1f}/{b.gpu_bytes / _GiB:.1f} GiB, "
        f"host {m.host / _GiB:.1f}/{b.host_bytes / _GiB:.1f} GiB, "
        f"disk {m.disk / _GiB:.1f}/{b.disk_bytes / _GiB:.1f} GiB"
    )


def check_config(path: str, args) -> tuple[list[str], str | None]:
    """The problem lines of one config (empty when it is ok), and a note on the plan, if checked."""
    from offloadkit.config import ConfigError, load_mapping

    problems = _Problems(path)
    try:
        data = load_mapping(path)
    except (ConfigError, OSError, UnicodeDecodeError) as exc:
        message = " ".join(str(exc).split())
        problems.add("file", message[len(path) + 2 :] if message.startswith(f"{path}: ") else message)
        return problems.lines(), None
    if getattr(args, "drop_unsupported_keys", False):
        data = dict(data, drop_unsupported_keys=True)
    cfg = _load_train_config(data, path, problems)
    if cfg is None:
        return problems.lines(), None
    if args.output_dir is not None:
        cfg.output_dir = args.output_dir
    if args.overwrite:
        cfg.overwrite_output_dir = True
    cfg = cfg.resolved(_cuda())
    note = None
    for check in (
        _check_output_dir,
        _check_disk_dirs,
        _check_model,
        _check_adapter,
        _check_data,
        _check_packages,
        _check_resume,
    ):
        try:
            check(cfg, problems)
        except Exception as exc:  # a check that did not foresee this config: one line, and go on
            problems.add(check.__name__.replace("_check_", ""), f"could not be checked ({type(exc).__name__}: {exc})")
    if cfg.offload.offload_plan == "auto" or args.plan:
        try:
            note = _check_plan(cfg, args, problems)
        except Exception as exc:
            problems.add("offload_plan", f"could not be planned ({type(exc).__name__}: {exc})")
    notes = problems.notes + ([note] if note else [])
    return problems.lines(), "; ".join(notes) or None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_check(args, log=print) -> int:
    """Check every config of ``args.configs``; returns 0 when all are ok, else 1."""
    bad = 0
    for path in args.configs:
        try:
            lines, note = check_config(path, args)
        except Exception as exc:  # never a traceback: the config gets one line
            lines, note = [_line(path, "config", f"could not be checked ({type(exc).__name__}: {exc})")], None
        for line in lines:
            log(line)
        if lines:
            bad += 1
            log(f"{path}: {len(lines)} problem{'s' if len(lines) != 1 else ''}")
        else:
            log(f"{path}: ok" + (f" ({note})" if note else ""))
    return 1 if bad else 0
