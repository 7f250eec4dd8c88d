"""Axolotl configs for ``offloadkit train``, as Axolotl users write them, mapped onto
:class:`~offloadkit.cli.train_config.TrainConfig`.

Keys offloadkit shares with Axolotl (``gradient_checkpointing``, ``activation_offloading``,
``learning_rate``, ...) keep their meaning, Axolotl's values included (``offload``,
``offload_disk``, ``hidden_states``). An empty key is unset, as in Axolotl. Keys that
cannot take effect here are accepted with one warning listing them; features offloadkit
does not have (RL trainers, multimodal processors, quantised bases, ...) are refused by
name; unknown keys stop with a suggestion. Every problem of a config is reported at once.
"""

from __future__ import annotations

import difflib
import warnings

from offloadkit.config import KEYS_HELP, ConfigProblemsError, unknown_keys

__all__ = ["looks_like_axolotl", "to_train_dict", "RENAMED", "WITHOUT_EFFECT", "UNSUPPORTED"]


# Axolotl name -> offloadkit name (same-named keys pass through unchanged).
RENAMED = {
    "base_model": "model",
    "tokenizer_config": "tokenizer",
    "sequence_len": "seq_len",
    "micro_batch_size": "batch_size",
    "lora_r": "lora_rank",
}
# Handled by the mapping below rather than renamed.
SPECIAL = (
    "datasets",
    "adapter",
    "lora_target_linear",
    "bf16",
    "fp16",
    "bfloat16",
    "float16",
    "flash_attention",
    "sdp_attention",
    "load_in_4bit",
    "load_in_8bit",
    "model_type",
    "cut_cross_entropy",
    "liger_fused_linear_cross_entropy",
    "chat_template_jinja",
    "peft_use_dora",
)
# Accepted, but nothing here acts on them (logging, hub, evaluation, kernels, multi-GPU
# settings of a one-process run, data preparation caches, ...).
WITHOUT_EFFECT = (
    "base_model_config",
    "tokenizer_type",
    "tokenizer_use_fast",
    "tokenizer_legacy",
    "tokenizer_use_mistral_common",
    "trust_remote_code",
    "is_llama_derived_model",
    "is_mistral_derived_model",
    "is_falcon_derived_model",
    "is_qwen_derived_model",
    "strict",
    "special_tokens",
    "tokens",
    "eot_tokens",
    "dataset_prepared_path",
    "val_set_size",
    "test_datasets",
    "shuffle_merged_datasets",
    "dataset_exact_deduplication",
    "skip_prepare_dataset",
    "sample_packing",
    "eval_sample_packing",
    "sample_packing_eff_est",
    "sample_packing_seq_len_multiplier",
    "sample_packing_sequentially",
    "pad_to_sequence_len",
    "max_packed_sequence_len",
    "group_by_length",
    "pretrain_multipack_attn",
    "streaming_multipack_buffer_size",
    "min_sample_len",
    "total_num_tokens",
    "curriculum_sampling",
    "xformers_attention",
    "flex_attention",
    "s2_attention",
    "flash_optimum",
    "flash_attn_fuse_mlp",
    "flash_attn_rms_norm",
    "flash_attn_cross_entropy",
    "flex_attn_compile_kwargs",
    "fused_attn_kernel",
    "gemma4_hybrid_attn_impl",
    "tf32",
    "wandb_project",
    "wandb_entity",
    "wandb_watch",
    "wandb_name",
    "wandb_run_id",
    "wandb_log_model",
    "use_wandb",
    "mlflow_tracking_uri",
    "mlflow_experiment_name",
    "use_tensorboard",
    "use_swanlab",
    "swanlab_project",
    "swanlab_experiment_name",
    "swanlab_description",
    "swanlab_mode",
    "swanlab_log_completions",
    "swanlab_completion_log_interval",
    "swanlab_completion_max_buffer",
    "swanlab_workspace",
    "swanlab_log_model",
    "trackio_project_name",
    "trackio_run_name",
    "trackio_space_id",
    "use_otel_metrics",
    "otel_metrics_host",
    "otel_metrics_port",
    "hub_model_id",
    "hub_strategy",
    "hf_use_auth_token",
    "push_dataset_to_hub",
    "evals_per_epoch",
    "eval_steps",
    "eval_strategy",
    "evaluation_strategy",
    "eval_table_size",
    "eval_max_new_tokens",
    "eval_causal_lm_metrics",
    "do_causal_lm_eval",
    "eval_batch_size",
    "saves_per_epoch",
    "save_strategy",
    "save_only_model",
    "save_safetensors",
    "early_stopping_patience",
    "local_rank",
    "debug",
    "deepspeed",
    "fsdp",
    "fsdp_config",
    "fsdp_version",
    "dp_shard_size",
    "dp_replicate_size",
    "ddp",
    "ddp_find_unused_parameters",
    "accelerator_config",
    "device_map",
    "low_cpu_mem_usage",
    "experimental_skip_move_to_device",
    "torchdistx_path",
    "warmup_ratio",
    "lora_fan_in_fan_out",
    "lora_model_dir",
    "peft_use_rslora",
    "torch_compile",
    "torch_compile_mode",
    "plugins",
    "liger_rope",
    "liger_rms_norm",
    "liger_rms_norm_gated",
    "liger_glu_activation",
    "liger_layer_norm",
    "use_kernels",
    "use_scattermoe",
    "use_sonicmoe",
    "lora_mlp_kernel",
    "lora_qkv_kernel",
    "lora_o_kernel",
    "experts_implementation",
    "use_dsv4_kernels",
    "dsv4_fp4_grouped_mode",
    "use_glm_dsa_kernels",
    "quantize_moe_experts",
    "llama4_linearized_experts",
    "resize_token_embeddings_to_32x",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "adam_eps",
    "cosine_min_lr_ratio",
    "cosine_constant_lr_ratio",
    "eta_min",
    "lr_quadratic_warmup",
    "loss_watchdog_threshold",
    "loss_watchdog_patience",
    "neftune_noise_alpha",
    "auto_resume_from_checkpoints",
    "remove_unused_columns",
    "revision_of_model",
    "base_model_ignore_patterns",
    "model_config",
    "test_value",
    "unsloth_cross_entropy_loss",
    "unsloth_lora_mlp",
    "unsloth_lora_qkv",
    "unsloth_lora_o",
    "unsloth_rms_norm",
    "unsloth_rope",
    "lora_dropout_layers",
    "torch_dtype",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "dataloader_prefetch_factor",
    "gc_steps",
    "include_tokens_per_second",
    "profiler_steps",
    "bnb_config_kwargs",
    "model_quantization_config_kwargs",
)
# Axolotl features offloadkit does not have: key -> what it is. Refused when set (not
# empty, false or 1 for the parallel sizes).
UNSUPPORTED = {
    "rl": "RL and preference training (rl: dpo, orpo, kto, grpo, ...)",
    "trl": "RL trainer settings (trl:)",
    "rl_beta": "RL and preference training",
    "orpo_alpha": "RL and preference training",
    "kto_desirable_weight": "RL and preference training",
    "vllm": "vLLM generation for RL",
    "reward_model": "reward-model training",
    "process_reward_model": "process-reward-model training",
    "center_rewards_coefficient": "reward-model training",
    "num_labels": "classification heads",
    "processor_type": "multimodal processors (images, audio)",
    "freeze_mm_modules": "multimodal models",
    "pretraining_dataset": "streaming pretraining datasets",
    "gptq": "GPTQ-quantised bases",
    "gptq_groupsize": "GPTQ-quantised bases",
    "gptq_model_v1": "GPTQ-quantised bases",
    "gptq_disable_exllama": "GPTQ-quantised bases",
    "model_quantization_config": "quantised bases",
    "llmcompressor": "llm-compressor sparsity",
    "qat": "quantisation-aware training",
    "fp8": "fp8 training",
    "fp8_enable_fsdp_float8_all_gather": "fp8 training",
    "nvfp4_merge_aware": "nvfp4 training",
    "use_onebitllms": "1-bit models",
    "diffusion": "diffusion language models",
    "ebft": "EBFT training",
    "lisa_n_layers": "LISA layer sampling",
    "lisa_step_interval": "LISA layer sampling",
    "lisa_layers_attribute": "LISA layer sampling",
    "relora": "ReLoRA",
    "relora_prune_ratio": "ReLoRA",
    "relora_cpu_offload": "ReLoRA",
    "jagged_restart_steps": "jagged learning-rate restarts",
    "jagged_restart_warmup_steps": "jagged learning-rate restarts",
    "jagged_restart_anneal_steps": "jagged learning-rate restarts",
    "use_ray": "Ray training",
    "ray_num_workers": "Ray training",
    "unfrozen_parameters": "training a chosen subset of the parameters",
    "lora_target_parameters": "LoRA on raw parameters (MoE expert tensors)",
    "reinit_weights": "re-initialised weights",
    "use_eaft": "EAFT loss",
    "eaft_alpha": "EAFT loss",
    "eaft_k": "EAFT loss",
    "cls_model_config": "classification heads",
    "peft": "PEFT configs other than LoRA (peft:)",
    "context_parallel_size": "context parallelism across GPUs (offloadkit's own is offloadkit.parallel)",
    "context_parapllel_size": "context parallelism across GPUs",
    "tensor_parallel_size": "tensor parallelism",
    "expert_parallel_size": "expert parallelism",
    "expert_parallel_num_nvl_bytes": "expert parallelism",
    "expert_parallel_token_capacity": "expert parallelism",
    "streaming": "streaming datasets",
    "full_finetune": "EBFT full fine-tuning",
}
_PARALLEL = ("context_parallel_size", "context_parapllel_size", "tensor_parallel_size", "expert_parallel_size")
# Keys only Axolotl uses: any of them marks a config as an Axolotl one.
_AXOLOTL_ONLY = set(RENAMED) | set(SPECIAL) | set(WITHOUT_EFFECT) | set(UNSUPPORTED)
_DATASET_KEYS = (
    "path",
    "type",
    "field",
    "ds_type",
    "data_files",
    "split",
    "name",
    "field_messages",
    "message_property_mappings",
    "message_field_role",
    "message_field_content",
    "roles",
    "roles_to_train",
    "train_on_eos",
    "drop_system_message",
    "field_thinking",
    "template_thinking_key",
    "chat_template",
    "trust_remote_code",
    "revision",
    "shards",
    "preprocess_shards",
)
_RL_DATASET_KEYS = (
    "field_chosen",
    "field_rejected",
    "field_prompt",
    "step_separator",
    "max_completion_length",
    "train_on_last_step_only",
)
_TYPES = {
    "completion": "completion",
    "text": "completion",
    "alpaca": "alpaca",
    "chat_template": "chat_template",
    "chat_template.default": "chat_template",
}
# Axolotl's named chat templates: offloadkit renders with the tokenizer's own template.
_TEMPLATE_NAMES = ("tokenizer_default", "tokenizer_default_fallback_chatml", "chatml", "jinja")
_MODEL_CLASSES_UNSUPPORTED = {
    "AutoModelForSequenceClassification": "sequence classification heads",
    "AutoModelForTokenClassification": "token classification heads",
    "AutoModelForImageTextToText": "multimodal models",
    "AutoModelForVision2Seq": "multimodal models",
}


def looks_like_axolotl(data: dict) -> bool:
    """True when ``data`` uses a key that only Axolotl configs have."""
    return any(key in _AXOLOTL_ONLY for key in data)


def _unset(value) -> bool:
    """Axolotl's "not set": an empty key (None), or an empty string/list/mapping."""
    return value is None or value == "" or value == [] or value == {}


class _Mapper:
    """One config's mapping: the output dict, names as written, warnings and problems."""

    def __init__(self, native_keys: list[str]) -> None:
        self.native = native_keys
        self.out: dict = {}
        self.names: dict = {}
        self.ignored: list[str] = []
        self.problems: list[tuple[str, bool]] = []

    def put(self, target: str, value, written: str) -> None:
        if target in self.out:
            self.fail(f"{written} and {self.names.get(target, target)} are the same setting ({target}); keep one")
            return
        self.out[target] = value
        self.names[target] = written

    def fail(self, message: str) -> None:
        self.problems.append((message, False))

    def refuse(self, message: str) -> None:
        self.problems.append((message, True))

    def dataset(self, index: int, entry) -> dict | None:
        where = f"datasets[{index}]"
        if not isinstance(entry, dict):
            self.fail(f"{where}={entry!r} must be a mapping like {{path: data/train.jsonl, type: alpaca}}")
            return None
        entry = {k: v for k, v in entry.items() if not _unset(v)}
        rl_keys = [k for k in entry if k in _RL_DATASET_KEYS]
        if rl_keys:
            self.refuse(
                f"{where} has {', '.join(rl_keys)}: preference data for RL training, which offloadkit train does not do"
            )
            return None
        unknown = [k for k in entry if k not in _DATASET_KEYS]
        if unknown:
            shown = [str(k) for k in unknown[:3]]
            more = f" and {len(unknown) - len(shown)} more" if len(unknown) > len(shown) else ""
            close = {k: difflib.get_close_matches(k, _DATASET_KEYS, n=1, cutoff=0.8) for k in shown}
            hints = [f"{c[0]!r} for {k!r}" for k, c in close.items() if c]
            shown = [k if len(k) <= 40 else k[:37] + "..." for k in shown]
            hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
            self.fail(
                f"{where} has unknown keys {shown}{more}{hint}; drop them (offloadkit reads Axolotl's path, type, "
                "field and chat_template keys)"
            )
        kind = entry.get("type", "completion")
        if not isinstance(kind, str) or kind not in _TYPES:
            self.refuse(
                f"{where}.type={kind!r}: offloadkit train reads the dataset types completion, alpaca and "
                "chat_template; other prompt formats are not supported"
            )
            return None
        path = entry.get("data_files") or entry.get("path")
        if isinstance(path, list) and len(path) == 1:
            path = path[0]
        if not isinstance(path, str):
            self.fail(f"{where}.path={path!r} must be one local file (.jsonl or .json; .txt for completion)")
            return None
        spec: dict = {"path": path, "type": _TYPES[kind]}
        if "field" in entry:
            spec["field"] = entry["field"]
        mappings = dict(entry.get("message_property_mappings") or {})
        for old, prop in (("message_field_role", "role"), ("message_field_content", "content")):
            if old in entry:
                mappings.setdefault(prop, entry[old])
        if mappings:
            spec["message_property_mappings"] = mappings
        for key in ("field_messages", "roles", "roles_to_train", "drop_system_message"):
            if key in entry:
                spec[key] = entry[key]
        for key in (
            "field_thinking",
            "template_thinking_key",
            "chat_template",
            "train_on_eos",
            "split",
            "name",
            "shards",
            "preprocess_shards",
            "revision",
            "trust_remote_code",
            "ds_type",
        ):
            if key in entry and not (key == "split" and entry[key] == "train"):
                self.ignored.append(f"{where}.{key}")
        return spec


def _map_keys(data: dict, m: _Mapper) -> None:
    unknown = []
    for key, value in data.items():
        if key == "batch_size" and "micro_batch_size" in data:
            # Axolotl's batch_size is the whole step (micro-batches x accumulation); offloadkit's
            # is one micro-batch, which micro_batch_size gives.
            micro = data["micro_batch_size"]
            if (
                isinstance(value, int)
                and isinstance(micro, int)
                and micro > 0
                and value % micro == 0
                and "gradient_accumulation_steps" not in data
            ):
                m.put("gradient_accumulation_steps", value // micro, "batch_size")
            elif data.get("gradient_accumulation_steps") not in (None, value // max(1, micro)):
                m.fail(
                    f"batch_size={value!r} is not micro_batch_size x gradient_accumulation_steps "
                    f"({micro} x {data['gradient_accumulation_steps']}); drop batch_size"
                )
            continue
        if key in RENAMED:
            m.put(RENAMED[key], value, key)
        elif key == "datasets":
            entries = value if isinstance(value, list) else [value]
            specs = [m.dataset(i, e) for i, e in enumerate(entries)]
            if len(specs) == 1 and specs[0] is not None and specs[0]["type"] == "completion":
                # One text dataset: offloadkit's own route (joined and cut into full blocks).
                m.put("dataset", specs[0]["path"], "datasets[0].path")
                if "field" in specs[0]:
                    m.put("text_field", specs[0]["field"], "datasets[0].field")
            elif all(s is not None for s in specs) and specs:
                m.put("datasets", specs, "datasets")
        elif key in SPECIAL:
            continue  # resolved below, once every key is known
        elif key in UNSUPPORTED:
            if key in _PARALLEL and value in (1, "1"):
                continue
            if value is not False:
                m.refuse(f"{key}={value!r}: {UNSUPPORTED[key]} is not something offloadkit train does")
        elif key in WITHOUT_EFFECT:
            if value not in (False,):
                m.ignored.append(key)
        elif key in m.native:
            m.put(key, value, key)
        else:
            unknown.append(key)
    if unknown:
        m.fail(f"{unknown_keys(unknown, set(m.native) | _AXOLOTL_ONLY, cutoff=0.8)}; {KEYS_HELP}")


def _map_adapter(data: dict, m: _Mapper) -> None:
    adapter = data.get("adapter")
    if data.get("load_in_8bit") is True:
        m.refuse(
            "load_in_8bit=true: 8-bit quantised bases; use load_in_4bit: true with adapter: qlora (QLoRA), or a "
            "16-bit base with adapter: lora"
        )
    if data.get("load_in_4bit") is True:
        m.put("load_in_4bit", True, "load_in_4bit")
    if adapter is None:
        # Without an adapter Axolotl fine-tunes every weight; its lora_* keys do nothing then.
        for written, target in (
            ("lora_r", "lora_rank"),
            ("lora_alpha", "lora_alpha"),
            ("lora_dropout", "lora_dropout"),
            ("lora_target_modules", "lora_target_modules"),
            ("lora_target_linear", None),
        ):
            if not _unset(data.get(written)) and data.get(written) is not False:
                m.ignored.append(f"{written} (no adapter: lora)")
                m.out.pop(target, None)
        m.out.setdefault("lora_rank", 0)
        return
    if adapter not in ("lora", "qlora"):
        m.fail(f"adapter={adapter!r} is not supported; use adapter: lora or qlora, or omit it for a full fine-tune")
        return
    m.out.setdefault("lora_rank", 8)
    if data.get("lora_target_linear"):
        m.out["lora_target_modules"] = "all-linear"
        m.names["lora_target_modules"] = "lora_target_linear"
    if adapter == "qlora":
        # QLoRA: LoRA adapters over a 4-bit (NF4) base, which Axolotl loads with load_in_4bit.
        m.out["load_in_4bit"] = True
        m.names.setdefault("load_in_4bit", "adapter")
    if data.get("peft_use_dora") is True:
        m.put("lora_use_dora", True, "peft_use_dora")


def _map_precision(data: dict, m: _Mapper) -> None:
    if "dtype" in m.out:
        return
    bf16, fp16 = data.get("bf16"), data.get("fp16")
    if data.get("bfloat16") is True:
        bf16 = True
    if data.get("float16") is True:
        fp16 = True
    if bf16 in (True, "auto") and fp16:
        m.fail("bf16 and fp16 are both on; keep one")
    elif bf16 is True:
        m.put("dtype", "bfloat16", "bf16")
    elif bf16 == "auto":
        m.put("dtype", "auto", "bf16")
    elif fp16 is True:
        m.put("dtype", "float16", "fp16")
    elif bf16 is False:
        m.put("dtype", "float32", "bf16")


def _map_values(data: dict, m: _Mapper) -> None:
    """Axolotl's values of shared keys, and keys that imply offloadkit settings."""
    out = m.out
    checkpointing = out.get("gradient_checkpointing")
    if checkpointing in ("offload", "offload_disk"):
        # Axolotl's older spellings of checkpointing with offloaded activations.
        out["gradient_checkpointing"] = True
        out.setdefault("activation_offloading", True if checkpointing == "offload" else "disk")
    if out.get("activation_offloading") == "hidden_states":
        # Offload only what checkpointing keeps, the decoder layers' inputs: offloadkit's
        # checkpoint-input offload, which is checkpointing with activation offloading.
        out["activation_offloading"] = True
        out.setdefault("gradient_checkpointing", True)
    model_class = data.get("model_type")
    if isinstance(model_class, str):
        if model_class in _MODEL_CLASSES_UNSUPPORTED:
            m.refuse(
                f"model_type={model_class!r}: {_MODEL_CLASSES_UNSUPPORTED[model_class]}; offloadkit train trains "
                "causal language models"
            )
        elif model_class.endswith("ForConditionalGeneration"):
            m.refuse(f"model_type={model_class!r}: multimodal models; offloadkit train trains causal language models")
        else:
            m.ignored.append("model_type")
    if "attn_implementation" not in out:
        if data.get("flash_attention") is True:
            m.put("attn_implementation", "flash_attention_2", "flash_attention")
        elif data.get("sdp_attention") is True:
            m.put("attn_implementation", "sdpa", "sdp_attention")
    if data.get("cut_cross_entropy") is True or data.get("liger_fused_linear_cross_entropy") is True:
        # Both compute the loss without full-vocabulary logits: offloadkit's chunked loss.
        written = "cut_cross_entropy" if data.get("cut_cross_entropy") is True else "liger_fused_linear_cross_entropy"
        if "chunked_cross_entropy" not in out:
            m.put("chunked_cross_entropy", True, written)
    template = out.get("chat_template")
    if template == "jinja":
        jinja = data.get("chat_template_jinja")
        if not isinstance(jinja, str) or not jinja:
            m.fail("chat_template=jinja needs chat_template_jinja: the template text")
        else:
            out["chat_template"] = jinja
    elif isinstance(template, str) and template not in _TEMPLATE_NAMES:
        m.ignored.append(f"chat_template: {template} (the tokenizer's own template is used)")
        out["chat_template"] = "tokenizer_default"


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
        ConfigProblemsError: every unknown key, unsupported value or feature, at once.
    """
    data = {k: v for k, v in data.items() if not _unset(v)}  # an empty key is unset
    m = _Mapper(native_keys)
    _map_keys(data, m)
    _map_adapter(data, m)
    _map_precision(data, m)
    _map_values(data, m)
    if m.problems:
        raise ConfigProblemsError(source, m.problems)
    if m.ignored:
        warnings.warn(
            f"offloadkit: {source}: these Axolotl keys have no effect in offloadkit train: {', '.join(m.ignored)}",
            UserWarning,
            stacklevel=3,
        )
    return m.out, m.names, m.ignored
