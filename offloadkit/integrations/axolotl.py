"""Axolotl configs for ``offloadkit train``, as Axolotl users write them, mapped onto
:class:`~offloadkit.cli.train_config.TrainConfig`.

Keys offloadkit shares with Axolotl (``gradient_checkpointing``, ``activation_offloading``,
``learning_rate``, ...) keep their meaning, Axolotl's values included (``offload``,
``offload_disk``, ``hidden_states``). An empty key is unset, as in Axolotl. Keys that change
the training (warmup_ratio, val_set_size, sample_packing, special_tokens, ...) are honoured
as TrainConfig keys of the same name; keys that do not change it (logging, hub, kernels,
caches, multi-GPU layouts) are accepted with one warning listing them; a key that changes
the training and cannot be honoured refuses the run with one line naming it, unless
``drop_unsupported_keys: true``; features offloadkit does not have (RL trainers, multimodal
processors, QAT, ...) are refused by name; unknown keys stop with a suggestion. Every problem
of a config is reported at once.
"""

from __future__ import annotations

import difflib
import warnings

from offloadkit.config import KEYS_HELP, ConfigProblemsError, unknown_keys

__all__ = ["looks_like_axolotl", "to_train_dict", "RENAMED", "WITHOUT_EFFECT", "NOT_HONOURED", "UNSUPPORTED"]


# Axolotl name -> offloadkit name (same-named keys pass through unchanged: warmup_ratio,
# val_set_size, sample_packing, special_tokens, lora_model_dir, ... are TrainConfig keys).
RENAMED = {
    "base_model": "model",
    "tokenizer_config": "tokenizer",
    "sequence_len": "seq_len",
    "micro_batch_size": "batch_size",
    "lora_r": "lora_rank",
    "peft_use_rslora": "lora_use_rslora",
    "adam_eps": "adam_epsilon",
    "revision_of_model": "model_revision",
    "bnb_config_kwargs": "quantization_kwargs",
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
    "torch_dtype",
    "flash_attention",
    "sdp_attention",
    "load_in_4bit",
    "load_in_8bit",
    "model_type",
    "cut_cross_entropy",
    "liger_fused_linear_cross_entropy",
    "chat_template_jinja",
    "peft_use_dora",
    "save_strategy",
    "eval_strategy",
    "evaluation_strategy",
    "plugins",
    "auto_resume_from_checkpoints",
    "base_model_config",
    "lora_mlp_kernel",
    "lora_qkv_kernel",
    "lora_o_kernel",
)
# Axolotl's fused LoRA kernels, per group of projections: offloadkit's fused LoRA path on the
# LoRA layers of those names (all three: every LoRA linear layer).
LORA_KERNELS = {
    "lora_qkv_kernel": ("q_proj", "k_proj", "v_proj", "qkv_proj"),
    "lora_o_kernel": ("o_proj",),
    "lora_mlp_kernel": ("gate_proj", "up_proj", "down_proj", "gate_up_proj"),
}
# Accepted without changing what is trained: how a run is logged or published, caches of
# data preparation, kernels and compilers that compute the same thing another way, and the
# layout of a multi-GPU run (one process here, with offloadkit's memory options instead).
# Listed in one warning.
WITHOUT_EFFECT = (
    "is_llama_derived_model",
    "is_mistral_derived_model",
    "is_falcon_derived_model",
    "is_qwen_derived_model",
    "strict",
    "dataset_prepared_path",
    "skip_prepare_dataset",
    "sample_packing_eff_est",
    "total_num_tokens",
    "xformers_attention",
    "flex_attention",
    "flash_optimum",
    "flash_attn_fuse_mlp",
    "flash_attn_rms_norm",
    "flash_attn_cross_entropy",
    "flex_attn_compile_kwargs",
    "fused_attn_kernel",
    "gemma4_hybrid_attn_impl",
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
    "eval_table_size",
    "eval_max_new_tokens",
    "eval_causal_lm_metrics",
    "do_causal_lm_eval",
    "save_safetensors",
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
    "context_parallel_size",
    "use_ray",  # Ray launches the data-parallel workers: a multi-GPU layout, as deepspeed and fsdp
    "ray_num_workers",
    "context_parapllel_size",
    "tensor_parallel_size",
    "expert_parallel_size",
    "expert_parallel_num_nvl_bytes",
    "device_map",
    "low_cpu_mem_usage",
    "experimental_skip_move_to_device",
    "torchdistx_path",
    "torch_compile",
    "torch_compile_mode",
    "liger_rope",
    "liger_rms_norm_gated",
    "liger_layer_norm",
    "use_kernels",
    "use_scattermoe",
    "use_sonicmoe",
    "experts_implementation",
    "use_dsv4_kernels",
    "dsv4_fp4_grouped_mode",
    "use_glm_dsa_kernels",
    "unsloth_cross_entropy_loss",
    "unsloth_lora_mlp",
    "unsloth_lora_qkv",
    "unsloth_lora_o",
    "unsloth_rms_norm",
    "unsloth_rope",
    "remove_unused_columns",
    "base_model_ignore_patterns",
    "test_value",
    "eta_min",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "dataloader_prefetch_factor",
    "gc_steps",
    "include_tokens_per_second",
    "profiler_steps",
)
# Keys that change what is trained and that offloadkit cannot honour: key -> what it does.
# Refused, one line each, unless drop_unsupported_keys: true.
NOT_HONOURED = {
    "cosine_constant_lr_ratio": "Axolotl's cosine schedule with a constant phase",
    "sample_packing_seq_len_multiplier": "packing several rows' worth of examples per row",
    "max_packed_sequence_len": "Axolotl's retired packing (Axolotl refuses it too; sample_packing packs rows)",
    "pretrain_multipack_attn": "packed pretraining attention",
    "streaming_multipack_buffer_size": "packing a streamed dataset",
    "curriculum_sampling_by": "curriculum ordering",
    "s2_attention": "shifted sparse attention (another attention)",
    "llama4_linearized_experts": "Llama 4 experts rebuilt as linear layers",
    "lora_dropout_layers": "LoRA dropout on chosen layers",
    "expert_parallel_token_capacity": "a cap on the tokens each expert takes (others dropped)",
    "test_datasets": "a separate evaluation dataset",
    "lora_layers_to_transform": "LoRA on chosen layers only",
    "peft_layers_to_transform": "LoRA on chosen layers only",
    "embeddings_skip_upcast": "embeddings kept in low precision",
    "chat_template_kwargs": "arguments to the chat template",
    "default_system_message": "a default system message",
    "shuffle_before_merging_datasets": "shuffling each dataset before merging",
    "tokenizer_use_mistral_common": "mistral-common's tokenizer and chat rendering",
}
# Axolotl features offloadkit does not have: key -> what it is. Refused when set (not
# empty, false or 1 for the parallel sizes).
UNSUPPORTED = {
    "rl": "RL and preference training other than DPO and KTO (rl: orpo, grpo, ...)",
    "trl": "RL trainer settings (trl:)",
    "orpo_alpha": "RL and preference training",
    "vllm": "vLLM generation for RL",
    "process_reward_model": "process-reward-model training",
    "processor_type": "multimodal processors (images, audio)",
    "freeze_mm_modules": "multimodal models",
    "gptq": "GPTQ-quantised bases",
    "gptq_groupsize": "GPTQ-quantised bases",
    "gptq_model_v1": "GPTQ-quantised bases",
    "gptq_disable_exllama": "GPTQ-quantised bases",
    "llmcompressor": "llm-compressor sparsity",
    "fp8": "fp8 training",
    "fp8_enable_fsdp_float8_all_gather": "fp8 training",
    "nvfp4_merge_aware": "nvfp4 training",
    "use_onebitllms": "1-bit models",
    "diffusion": "diffusion language models",
    "ebft": "EBFT training",
    "relora": "ReLoRA",
    "relora_prune_ratio": "ReLoRA",
    "relora_cpu_offload": "ReLoRA",
    "jagged_restart_steps": "jagged learning-rate restarts",
    "jagged_restart_warmup_steps": "jagged learning-rate restarts",
    "jagged_restart_anneal_steps": "jagged learning-rate restarts",
    "use_eaft": "EAFT loss",
    "eaft_alpha": "EAFT loss",
    "eaft_k": "EAFT loss",
    "cls_model_config": "classification heads",
    "peft": "PEFT configs other than LoRA (peft:)",
    "streaming": "streaming datasets",
    "full_finetune": "EBFT full fine-tuning",
}
# Keys only Axolotl uses: any of them marks a config as an Axolotl one.
_AXOLOTL_ONLY = set(RENAMED) | set(SPECIAL) | set(WITHOUT_EFFECT) | set(UNSUPPORTED) | set(NOT_HONOURED)
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
    "shards_idx",
    "preprocess_shards",
    "train_on_eot",
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
    "jeopardy": "jeopardy",
    "bradley_terry": "bradley_terry",
    "chat_template": "chat_template",
    "chat_template.default": "chat_template",
}
# How warmup_ratio is named when it is Axolotl's default (3% of the steps, at most 100).
AXOLOTL_DEFAULT_WARMUP = "warmup_ratio (Axolotl's default: 3% of the steps, at most 100)"
# Plugins whose effect is the keys next to them (mapped, or without effect on training).
_PLUGINS = {
    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin": "cut_cross_entropy",
    "axolotl.integrations.liger.LigerPlugin": "liger_* kernels",
    "axolotl.integrations.kernels.KernelsPlugin": "kernels",
    "axolotl.integrations.swanlab.SwanLabPlugin": "logging",
    "axolotl.integrations.expert_parallel.ExpertParallelPlugin": "multi-GPU expert layout",
}
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

    def __init__(self, native_keys: list[str], drop: bool, rl=None, reward_model: bool = False) -> None:
        self.native = native_keys
        self.drop = drop
        self.reward_model = reward_model  # bradley_terry datasets are read for reward_model: true
        self.rl = rl  # the config's rl: preference datasets are read for rl: dpo
        self.out: dict = {}
        self.names: dict = {}
        self.ignored: list[str] = []
        self.dropped: list[str] = []
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

    def not_honoured(self, key: str, value, what: str) -> None:
        """A key that changes the training and cannot be honoured: refused with one line,
        or dropped when the config asks for that (drop_unsupported_keys)."""
        if self.drop:
            self.dropped.append(f"{key} ({what})")
            return
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        self.refuse(
            f"{key}={shown}: {what}, which offloadkit cannot honour; it changes the training, so the run stops "
            "(drop_unsupported_keys: true trains without it)"
        )

    def dataset(self, index: int | str, entry, rl: bool = True) -> dict | None:
        where = index if isinstance(index, str) else f"datasets[{index}]"
        if not isinstance(entry, dict):
            self.fail(f"{where}={entry!r} must be a mapping like {{path: data/train.jsonl, type: alpaca}}")
            return None
        entry = {k: v for k, v in entry.items() if not _unset(v)}
        rl_keys = [k for k in entry if k in _RL_DATASET_KEYS]
        if rl and self.rl == "dpo":
            return self._preference_dataset(where, entry)
        if rl and self.rl == "kto":
            return self._kto_dataset(where, entry)
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
        from offloadkit.data.sft import PROMPT_STYLES

        kind = entry.get("type", "completion")
        if self.reward_model and kind in ("bradley_terry", "bradley_terry.chat_template"):
            kind = "bradley_terry"  # pairs of system, input, chosen and rejected texts
        style = None
        if isinstance(kind, str) and ":" in kind and kind.split(":", 1)[0] in ("alpaca", "jeopardy"):
            # Axolotl's TYPE:STYLE: the instruction prompt in another style (alpaca:chat, alpaca:phi, ...).
            style = kind.split(":", 1)[1]
        if not isinstance(kind, str) or (kind not in _TYPES and style not in PROMPT_STYLES):
            self.refuse(
                f"{where}.type={kind!r}: offloadkit train reads the dataset types completion, alpaca (and "
                "alpaca:chat, :chatml, :phi), jeopardy and chat_template; other prompt formats are not supported"
            )
            return None
        if style is not None:
            kind = kind.split(":", 1)[0]
        path = entry.get("data_files") or entry.get("path")
        if isinstance(path, list) and len(path) == 1:
            path = path[0]
        if not isinstance(path, str):
            self.fail(f"{where}.path={path!r} must be one local file (.jsonl or .json; .txt for completion)")
            return None
        spec: dict = {"path": path, "type": _TYPES[kind]}
        if style is not None and style != "instruct":
            spec["prompt_style"] = style
        if "field" in entry:
            spec["field"] = entry["field"]
        mappings = dict(entry.get("message_property_mappings") or {})
        for old, prop in (("message_field_role", "role"), ("message_field_content", "content")):
            if old in entry:
                mappings.setdefault(prop, entry[old])
        if mappings:
            spec["message_property_mappings"] = mappings
        for key in (
            "field_messages",
            "roles",
            "roles_to_train",
            "drop_system_message",
            "field_thinking",
            "template_thinking_key",
            "shards",
            "shards_idx",
        ):
            if key in entry:
                spec[key] = entry[key]
        split = entry.get("split")
        if isinstance(split, str) and (split == "train" or split.startswith("train[")):
            if split != "train":
                spec["split"] = split  # a slice of the file's records, as the hub's split syntax takes it
        elif split is not None:
            self.not_honoured(f"{where}.split", split, "a split other than train (a local file has one)")
        for key in ("train_on_eos", "train_on_eot"):
            if key in entry and entry[key] != "turn":
                # offloadkit trains each trained turn through its end-of-turn tokens: Axolotl's "turn".
                self.not_honoured(f"{where}.{key}", entry[key], "end-of-turn tokens trained other than per turn")
        template = entry.get("chat_template")
        if template is not None:
            spec["_chat_template"] = template
        # Where a hub dataset is read from, and how it is prepared: nothing to do for a local file.
        for key in ("name", "revision", "trust_remote_code", "ds_type", "preprocess_shards"):
            if key in entry:
                self.ignored.append(f"{where}.{key}")
        return spec

    def _preference_dataset(self, where: str, entry: dict) -> dict | None:
        """A dataset of an rl: dpo config: Axolotl's chat_template preference layout (a
        conversation, the chosen and the rejected answer)."""
        kind = entry.get("type", "chat_template")
        if kind not in ("chat_template", "chat_template.default"):
            self.refuse(
                f"{where}.type={kind!r}: rl: dpo reads the preference type chat_template.default (a conversation "
                "with chosen and rejected answers); other preference formats are not supported"
            )
            return None
        other = [k for k in entry if k in _RL_DATASET_KEYS and k not in ("field_chosen", "field_rejected")]
        if other:
            self.refuse(f"{where} has {', '.join(other)}: not read for rl: dpo preference pairs")
            return None
        spec = self.dataset(
            where, {k: v for k, v in entry.items() if k not in ("field_chosen", "field_rejected")}, rl=False
        )
        if spec is None:
            return None
        spec["type"] = "chat_template"
        for key in ("field_chosen", "field_rejected"):
            if key in entry:
                spec[key] = entry[key]
        return spec

    def _kto_dataset(self, where: str, entry: dict) -> dict | None:
        """A dataset of an rl: kto config: Axolotl's llama3.ultra or chatml.ultra (a prompt, one
        completion and whether it is desirable)."""
        kind = entry.get("type")
        styles = {"llama3.ultra": "llama3", "chatml.ultra": "chatml"}
        if kind not in styles:
            self.refuse(
                f"{where}.type={kind!r}: rl: kto reads the types llama3.ultra and chatml.ultra (prompt, completion, "
                "label); other formats are not supported"
            )
            return None
        spec = self.dataset(where, dict(entry, type="completion"), rl=False)
        if spec is None:
            return None
        spec.update(type="kto", prompt_style=styles[kind])
        return spec


def _map_pretraining(value, data: dict, m: _Mapper) -> None:
    """Axolotl's ``pretraining_dataset``: text documents read whole (not streamed: the same
    documents and loss, the order shuffled over the whole set rather than a stream's buffer),
    as completion datasets."""
    if "datasets" in data:
        m.fail("pretraining_dataset and datasets both name the training data; keep one")
        return
    if data.get("rl") in ("dpo", "kto"):
        m.fail(f"pretraining_dataset is plain text and rl={data['rl']!r} trains on preference data; keep one")
        return
    entries = value if isinstance(value, list) else [value]
    specs = []
    for i, entry in enumerate(entries):
        where = f"pretraining_dataset[{i}]"
        if not isinstance(entry, dict):
            m.fail(f"{where}={entry!r} must be a mapping like {{path: data/c4.jsonl, type: pretrain}}")
            return
        kind = entry.get("type", "pretrain")
        if kind not in ("pretrain", "completion"):
            m.refuse(f"{where}.type={kind!r}: offloadkit reads pretraining text (type: pretrain)")
            return
        if entry.get("skip"):
            m.not_honoured(f"{where}.skip", entry["skip"], "documents skipped at the stream's start")
        known = {"path", "name", "split", "text_column", "type", "data_files", "trust_remote_code", "skip"}
        extra = sorted(str(k) for k in entry if k not in known)
        if extra:
            m.fail(f"{where} has unknown keys {extra}; offloadkit reads path, name, split, text_column and type")
            return
        fields = {k: v for k, v in entry.items() if k in ("path", "data_files", "split", "name")}
        spec = m.dataset(where, dict(fields, type="completion", field=entry.get("text_column") or "text"), rl=False)
        if spec is None:
            return
        specs.append(spec)
    m.put("datasets", specs, "pretraining_dataset")


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
            if len(specs) == 1 and specs[0] is not None and set(specs[0]) <= {"path", "type", "field"}:
                if specs[0]["type"] == "completion":
                    # One text dataset: offloadkit's own route (joined and cut into full blocks).
                    m.put("dataset", specs[0]["path"], "datasets[0].path")
                    if "field" in specs[0]:
                        m.put("text_field", specs[0]["field"], "datasets[0].field")
                    continue
            if all(s is not None for s in specs) and specs:
                templates = {s.pop("_chat_template") for s in specs if s and "_chat_template" in s}  # type: ignore[union-attr]
                if templates:
                    _dataset_template(templates, data, m)
                m.put("datasets", specs, "datasets")
        elif key == "pretraining_dataset":
            _map_pretraining(value, data, m)
        elif key == "rl":
            if value in ("dpo", "kto"):
                m.put("rl", value, key)
            elif value is not False:
                m.refuse(f"{key}={value!r}: {UNSUPPORTED[key]} is not something offloadkit train does")
        elif key in SPECIAL:
            continue  # resolved below, once every key is known
        elif key in UNSUPPORTED:
            if value is not False:
                m.refuse(f"{key}={value!r}: {UNSUPPORTED[key]} is not something offloadkit train does")
        elif key == "cosine_constant_lr_ratio" and value == 0:
            # Axolotl's scheduler reads 0 as unset: the schedule is the one without it.
            m.ignored.append("cosine_constant_lr_ratio (0: Axolotl's schedule reads it as unset)")
        elif key in NOT_HONOURED:
            if value is not False:
                m.not_honoured(key, value, NOT_HONOURED[key])
        elif key in WITHOUT_EFFECT:
            if value not in (False,):
                m.ignored.append(key)
        elif key in m.native:
            m.put(key, value, key)
        else:
            unknown.append(key)
    if unknown:
        m.fail(f"{unknown_keys(unknown, set(m.native) | _AXOLOTL_ONLY, cutoff=0.8)}; {KEYS_HELP}")


def _dataset_template(templates: set, data: dict, m: _Mapper) -> None:
    """A dataset's own chat_template: honoured when it is the config's (or the only one)."""
    overall = data.get("chat_template")
    if len(templates) == 1 and (overall is None or templates == {overall}):
        if overall is None:
            m.put("chat_template", templates.pop(), "datasets[].chat_template")
        return
    m.not_honoured(
        "datasets[].chat_template", sorted(map(str, templates)), "a chat template per dataset other than the config's"
    )


def _map_adapter(data: dict, m: _Mapper) -> None:
    adapter = data.get("adapter")
    for key in ("load_in_4bit", "load_in_8bit"):
        if data.get(key) is True:
            m.put(key, True, key)
    if adapter is None:
        # Without an adapter Axolotl fine-tunes every weight; its LoRA keys do nothing then.
        for written, target in (
            ("lora_r", "lora_rank"),
            ("lora_alpha", "lora_alpha"),
            ("lora_dropout", "lora_dropout"),
            ("lora_target_modules", "lora_target_modules"),
            ("lora_target_linear", None),
            ("lora_model_dir", "lora_model_dir"),
            ("peft_use_rslora", "lora_use_rslora"),
            ("lora_fan_in_fan_out", "lora_fan_in_fan_out"),
            ("lora_target_parameters", "lora_target_parameters"),
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
    elif "lora_target_modules" not in data:
        # Axolotl adapts only the modules named (and the parameters of lora_target_parameters).
        m.out["lora_target_modules"] = []
    if adapter == "qlora" and data.get("load_in_8bit") is not True:
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
    torch_dtype = data.get("torch_dtype")
    if torch_dtype is not None and bf16 is None and not fp16:
        names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}
        names.update(float32="float32", fp32="float32", auto="auto")
        if str(torch_dtype).replace("torch.", "") in names:
            m.put("dtype", names[str(torch_dtype).replace("torch.", "")], "torch_dtype")
        else:
            m.fail(f"torch_dtype={torch_dtype!r} is not a dtype; use bfloat16, float16 or float32")
        return
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


def _map_model_class(data: dict, m: _Mapper) -> None:
    model_class = data.get("model_type")
    if not isinstance(model_class, str):
        return
    if model_class == "AutoModelForSequenceClassification" and data.get("reward_model") is True:
        m.put("model_class", model_class, "model_type")  # a reward model's one-score head
    elif model_class in _MODEL_CLASSES_UNSUPPORTED:
        m.refuse(
            f"model_type={model_class!r}: {_MODEL_CLASSES_UNSUPPORTED[model_class]}; offloadkit train trains "
            "causal language models"
        )
    elif model_class.endswith("ForConditionalGeneration"):
        m.refuse(f"model_type={model_class!r}: multimodal models; offloadkit train trains causal language models")
    elif model_class != "AutoModelForCausalLM":
        try:
            import transformers

            known = hasattr(transformers, model_class)
        except ImportError:  # checked when the model loads
            known = True
        if known:
            m.put("model_class", model_class, "model_type")
        else:
            m.refuse(
                f"model_type={model_class!r} is not a transformers class (another library's model); offloadkit "
                "train loads transformers' causal LMs"
            )


def _map_schedules(data: dict, m: _Mapper) -> None:
    """Axolotl's save_strategy and eval_strategy, as the steps offloadkit takes them in."""
    save = data.get("save_strategy")
    if save == "no":
        for key in ("save_steps", "saves_per_epoch"):
            m.out.pop(key, None)
    elif save == "epoch":
        m.out.pop("save_steps", None)
        m.out["saves_per_epoch"] = 1
        m.names["saves_per_epoch"] = "save_strategy"
    elif save not in (None, "steps"):
        m.not_honoured("save_strategy", save, "checkpoints chosen by a metric")
    for key in ("eval_strategy", "evaluation_strategy"):
        value = data.get(key)
        if value == "no":
            m.out.pop("eval_steps", None)
            m.out["evals_per_epoch"] = 0
            m.names["evals_per_epoch"] = key
        elif value == "epoch":
            m.out.pop("eval_steps", None)
            m.out["evals_per_epoch"] = 1
            m.names["evals_per_epoch"] = key
        elif value not in (None, "steps"):
            m.not_honoured(key, value, "an evaluation schedule other than steps, epoch or no")
    if data.get("sample_packing") is True and data.get("eval_sample_packing") is False:
        # Axolotl then leaves out each epoch's last, partial batch.
        m.out.setdefault("dataloader_drop_last", True)
    if "warmup_steps" not in data and "warmup_ratio" not in data:
        # Axolotl warms up over 3% of the steps (at most 100) when neither is given.
        m.out["warmup_ratio"] = 0.03
        m.names["warmup_ratio"] = AXOLOTL_DEFAULT_WARMUP
    if data.get("auto_resume_from_checkpoints") is True:
        m.put("auto_resume_from_checkpoints", True, "auto_resume_from_checkpoints")
    config_dir = data.get("base_model_config")
    if config_dir is not None and config_dir != data.get("base_model"):
        m.not_honoured("base_model_config", config_dir, "a model config from another place than base_model")
    plugins = data.get("plugins")
    for plugin in plugins if isinstance(plugins, list) else [plugins] if plugins else []:
        if plugin in _PLUGINS:
            m.ignored.append(f"plugins: {str(plugin).rsplit('.', 1)[-1]}")
        elif not any(str(plugin).endswith(name) for name in ("DiffusionPlugin", "LLMCompressorPlugin")):
            m.not_honoured("plugins", plugin, "an Axolotl plugin")  # the two others' keys are refused by name


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
    if isinstance(out.get("tokens"), dict):
        # Axolotl's older spelling of special_tokens (bos_token, eos_token, pad_token, ...).
        m.names.pop("tokens", None)
        m.put("special_tokens", out.pop("tokens"), "tokens")
    _map_model_class(data, m)
    _map_schedules(data, m)
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
    kernels = [key for key in LORA_KERNELS if data.get(key) is True]
    declined = [key for key in LORA_KERNELS if data.get(key) is False]
    if kernels and "fused_lora" not in out:
        names = [name for key in kernels for name in LORA_KERNELS[key]]
        m.put("fused_lora", True if len(kernels) == len(LORA_KERNELS) else names, "/".join(kernels))
    elif declined and "fused_lora" not in out:
        # Kernels declined and none asked for: PEFT's path, also where offload_plan: auto would fuse.
        m.put("fused_lora", False, "/".join(declined))
    if out.get("chat_template") == "jinja":
        jinja = data.get("chat_template_jinja")
        if not isinstance(jinja, str) or not jinja:
            m.fail("chat_template=jinja needs chat_template_jinja: the template text")
        else:
            out["chat_template"] = jinja
    # Other named templates (llama3, gemma3, qwen3, ...) are the model family's own format:
    # rendered with the tokenizer's template, checked to be that family's when the model loads.


def to_train_dict(data: dict, native_keys: list[str], source: str) -> tuple[dict, dict, list[str], list[str]]:
    """Map an Axolotl config onto ``TrainConfig`` keys.

    Args:
        data: the config as read from YAML.
        native_keys: offloadkit's own keys (accepted as they are, next to Axolotl's).
        source: the file name, for messages.

    Returns:
        ``(mapped, names, ignored, dropped)``: the TrainConfig dict, offloadkit key -> key as
        written (for messages), the keys without effect on training, and the keys not
        honoured that ``drop_unsupported_keys: true`` dropped (both warned about, once).

    Raises:
        ConfigProblemsError: every unknown key, unsupported value or feature, and every key
            that changes the training and cannot be honoured (unless dropped), at once.
    """
    data = {k: v for k, v in data.items() if not _unset(v)}  # an empty key is unset
    m = _Mapper(
        native_keys,
        drop=data.get("drop_unsupported_keys") is True,
        rl=data.get("rl"),
        reward_model=data.get("reward_model") is True,
    )
    _map_keys(data, m)
    _map_adapter(data, m)
    _map_precision(data, m)
    _map_values(data, m)
    if m.problems:
        raise ConfigProblemsError(source, m.problems)
    if m.ignored:
        warnings.warn(
            f"offloadkit: {source}: these Axolotl keys do not change the training and are not used: "
            f"{', '.join(m.ignored)}",
            UserWarning,
            stacklevel=3,
        )
    if m.dropped:
        warnings.warn(
            f"offloadkit: {source}: drop_unsupported_keys: training without {', '.join(m.dropped)}",
            UserWarning,
            stacklevel=3,
        )
    return m.out, m.names, m.ignored, m.dropped
