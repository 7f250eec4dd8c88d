"""Axolotl configs for ``offloadkit train``: the common keys, as Axolotl users write them,
mapped onto :class:`~offloadkit.cli.train_config.TrainConfig`.

Keys offloadkit shares with Axolotl (``gradient_checkpointing``, ``activation_offloading``,
``learning_rate``, ...) keep their meaning. Axolotl keys that cannot take effect here are
accepted with one warning listing them; keys unknown to both stop with a suggestion.
"""

from __future__ import annotations

import difflib
import warnings

from offloadkit.config import ConfigError

__all__ = ["looks_like_axolotl", "to_train_dict", "RENAMED", "WITHOUT_EFFECT"]

# Axolotl name -> offloadkit name (same-named keys pass through unchanged).
RENAMED = {
    "base_model": "model",
    "tokenizer_config": "tokenizer",
    "sequence_len": "seq_len",
    "micro_batch_size": "batch_size",
    "lora_r": "lora_rank",
}
# Handled by the mapping below rather than renamed.
SPECIAL = ("datasets", "adapter", "lora_target_linear", "bf16", "fp16")
# Accepted, but nothing here acts on them.
WITHOUT_EFFECT = (
    "base_model_config", "model_type", "tokenizer_type", "trust_remote_code", "is_llama_derived_model",
    "is_mistral_derived_model", "load_in_8bit", "load_in_4bit", "strict", "special_tokens", "tokens",
    "chat_template", "dataset_prepared_path", "val_set_size", "test_datasets", "shuffle_merged_datasets",
    "sample_packing", "eval_sample_packing", "pad_to_sequence_len", "train_on_inputs", "group_by_length",
    "flash_attention", "sdp_attention", "xformers_attention", "flex_attention", "s2_attention", "tf32",
    "wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_run_id", "wandb_log_model",
    "mlflow_tracking_uri", "mlflow_experiment_name", "hub_model_id", "hub_strategy", "push_dataset_to_hub",
    "evals_per_epoch", "eval_steps", "eval_table_size", "eval_max_new_tokens", "saves_per_epoch",
    "early_stopping_patience", "local_rank", "debug", "deepspeed", "fsdp", "fsdp_config", "weight_decay",
    "max_grad_norm", "warmup_ratio", "lora_fan_in_fan_out", "lora_modules_to_save", "lora_model_dir",
    "peft_use_dora", "peft_use_rslora", "unfrozen_parameters", "torch_compile", "plugins",
    "liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm", "liger_fused_linear_cross_entropy",
    "ddp_find_unused_parameters", "resize_token_embeddings_to_32x", "adam_beta1", "adam_beta2", "adam_epsilon",
    "cosine_min_lr_ratio", "loss_watchdog_threshold", "loss_watchdog_patience", "neftune_noise_alpha",
)
# Keys only Axolotl uses: any of them marks a config as an Axolotl one.
_AXOLOTL_ONLY = set(RENAMED) | set(SPECIAL) | set(WITHOUT_EFFECT)
_DATASET_KEYS = ("path", "type", "field", "ds_type", "data_files", "split", "name")
_TEXT_TYPES = ("completion", "text")


def looks_like_axolotl(data: dict) -> bool:
    """True when ``data`` uses a key that only Axolotl configs have."""
    return any(key in _AXOLOTL_ONLY for key in data)


def _dataset(entries, source: str) -> tuple[str, str | None]:
    """The one local file of ``datasets`` and its text field."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: datasets={entries!r} must be a list of entries like "
                          "[{path: data/train.jsonl, type: completion}]")
    if len(entries) > 1:
        paths = [e.get("path") if isinstance(e, dict) else e for e in entries]
        raise ConfigError(f"{source}: datasets has {len(entries)} entries ({paths}); offloadkit train reads one "
                          "dataset file: join them into one .jsonl, or keep one entry")
    entry = entries[0]
    if not isinstance(entry, dict):
        raise ConfigError(f"{source}: datasets[0]={entry!r} must be a mapping like {{path: data/train.jsonl, "
                          "type: completion}}")
    unknown = [k for k in entry if k not in _DATASET_KEYS]
    if unknown:
        raise ConfigError(f"{source}: datasets[0] has unknown keys {unknown}; offloadkit reads "
                          f"{', '.join(_DATASET_KEYS)}")
    kind = entry.get("type", "completion")
    if kind not in _TEXT_TYPES:
        raise ConfigError(f"{source}: datasets[0].type={kind!r} is not supported; offloadkit train reads "
                          "completion/text data (type: completion, one text field per record): convert the "
                          "records to text, or train with Axolotl")
    path = entry.get("data_files") or entry.get("path")
    if isinstance(path, list) and len(path) == 1:
        path = path[0]
    if not isinstance(path, str):
        raise ConfigError(f"{source}: datasets[0].path={path!r} must be one local file (.jsonl, .json or .txt)")
    return path, entry.get("field")


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    return f"did you mean {close[0]!r}?" if close else "see offloadkit train --help for the keys"


def to_train_dict(data: dict, native_keys: list[str], source: str) -> tuple[dict, dict, list[str]]:
    """Map an Axolotl config onto ``TrainConfig`` keys.

    Args:
        data: the config as read from YAML.
        native_keys: offloadkit's own keys (accepted as they are, next to Axolotl's).
        source: the file name, for messages.

    Returns:
        ``(mapped, names, ignored)``: the TrainConfig dict, offloadkit key -> key as written
        (for messages), and the keys without effect (already warned about, once).

    Raises:
        ConfigError: unknown keys, unsupported values, or a key given under both names.
    """
    known = sorted(set(native_keys) | _AXOLOTL_ONLY)
    out: dict = {}
    names: dict = {}
    ignored: list[str] = []

    def put(target: str, value, written: str) -> None:
        if target in out:
            raise ConfigError(f"{source}: {written} and {names.get(target, target)} are the same setting "
                              f"({target}); keep one")
        out[target] = value
        names[target] = written

    for key, value in data.items():
        if key in RENAMED:
            put(RENAMED[key], value, key)
        elif key == "datasets":
            path, text_field = _dataset(value, source)
            put("dataset", path, "datasets[0].path")
            if text_field is not None:
                put("text_field", text_field, "datasets[0].field")
        elif key in ("adapter", "lora_target_linear", "bf16", "fp16"):
            continue  # resolved below, once every key is known
        elif key in WITHOUT_EFFECT:
            if value not in (None, False, [], {}, ""):
                ignored.append(key)
        elif key in native_keys:
            put(key, value, key)
        else:
            raise ConfigError(f"{source}: unknown key {key!r} (value {value!r}); {_suggest(key, known)}")

    adapter = data.get("adapter")
    if adapter in (None, "", False):
        # Without an adapter Axolotl fine-tunes every weight; its lora_* keys do nothing then.
        for written, target in (("lora_r", "lora_rank"), ("lora_alpha", "lora_alpha"),
                                ("lora_dropout", "lora_dropout"), ("lora_target_modules", "lora_target_modules"),
                                ("lora_target_linear", None)):
            if data.get(written) not in (None, False, [], ""):
                ignored.append(f"{written} (no adapter: lora)")
                out.pop(target, None)
        out.setdefault("lora_rank", 0)
    elif adapter == "lora":
        out.setdefault("lora_rank", 8)
    elif adapter == "qlora":
        raise ConfigError(f"{source}: adapter='qlora' needs a 4-bit quantised base, which offloadkit train does not "
                          "load; use adapter: lora (layer_offloading: true keeps the frozen base in host memory)")
    else:
        raise ConfigError(f"{source}: adapter={adapter!r} is not supported; use adapter: lora, or omit it for a "
                          "full fine-tune")
    if adapter == "lora" and data.get("lora_target_linear"):
        out["lora_target_modules"] = "all-linear"
        names["lora_target_modules"] = "lora_target_linear"
    if "dtype" not in out:
        if data.get("bf16") in (True, "auto") and data.get("fp16"):
            raise ConfigError(f"{source}: bf16 and fp16 are both on; keep one")
        if data.get("bf16") is True:
            put("dtype", "bfloat16", "bf16")
        elif data.get("fp16") is True:
            put("dtype", "float16", "fp16")
        elif data.get("bf16") is False:
            put("dtype", "float32", "bf16")
    if out.get("gradient_checkpointing") == "offload":
        # Axolotl's older spelling of checkpointing with offloaded activations.
        out["gradient_checkpointing"] = True
        out.setdefault("activation_offloading", True)
    if ignored:
        warnings.warn(f"offloadkit: {source}: these Axolotl keys have no effect in offloadkit train: "
                      f"{', '.join(ignored)}", UserWarning, stacklevel=3)
    return out, names, ignored
