"""What an ``offloadkit train`` run is built from: the weights' dtype, the model and tokenizer
(LoRA adapters included), the training data and the Trainer's arguments. The run with
offloadkit (:mod:`offloadkit.cli.train`) and the plain run it is compared with
(:mod:`offloadkit.cli.compare`, also in a process of its own) build theirs here, the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types
from typing import Any

import torch

from offloadkit.cli.train_config import TrainConfig
from offloadkit.config import ConfigError
from offloadkit.extras import check, needs

__all__ = [
    "TrainingData",
    "load_dtype",
    "load_model",
    "quiet",
    "schedule",
    "trainable",
    "training_args",
    "training_data",
    "with_lora",
]


def load_dtype(cfg: TrainConfig, cuda: bool) -> torch.dtype:
    """The dtype the weights are loaded in. float16 is mixed precision, as the Trainer's and
    Axolotl's fp16: what trains is fp32 (full fine-tune: every weight; LoRA: the adapters,
    which PEFT keeps in fp32 over an fp16 frozen base), under fp16 autocast with a loss
    scaler. fp16 weights trained with AdamW directly overflow within steps."""
    if cfg.dtype == "float16":
        frozen_base = cfg.lora_rank and not cfg.lora_modules_to_save
        return torch.float16 if frozen_base else torch.float32
    return {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16, "float32": torch.float32}[
        cfg.dtype
    ]


def load_model(cfg: TrainConfig, device: str, dtype: torch.dtype):
    """The model on ``device`` in ``dtype``, its tokenizer and the model's name for the report:
    the tokenizer with the config's special tokens and chat template, the embeddings grown
    to the tokenizer, and packing checked to keep documents apart."""
    from offloadkit.data import BYTE_VOCAB_SIZE, byte_tokenizer
    from offloadkit.models.zoo import build_llama

    if cfg.load_in_4bit or cfg.load_in_8bit:
        model, tokenizer, name = _load_quantized(cfg, device, dtype)
    elif cfg.model is None:
        # The vocabulary is the byte tokenizer's: ids past it would never be trained.
        model = build_llama(
            cfg.model_shape,
            dtype=dtype,
            device=device,
            seed=cfg.seed,
            attn_implementation=cfg.attn_implementation or "sdpa",
            vocab_size=BYTE_VOCAB_SIZE,
            max_position_embeddings=max(cfg.seq_len, 2048),
        )
        tokenizer, name = byte_tokenizer(), f"built-in '{cfg.model_shape}' Llama (random init)"
    else:
        tokenizer = _load_tokenizer(cfg)
        model = _from_pretrained(cfg, cfg.model, dtype).to(device)
        name = cfg.model
    tokenizer = _with_template(cfg, tokenizer, model)
    _add_tokens(cfg, tokenizer, model)
    if cfg.qat:
        from offloadkit.cli.qat import apply_qat

        with needs("offloadkit train (qat)", "lowbit-optim"):
            try:
                apply_qat(model, cfg.qat)
            except ValueError as exc:
                raise ConfigError(f"{cfg.name('qat')}: {exc}") from None
    if cfg.reward_model and getattr(model.config, "pad_token_id", None) is None:
        # A sequence classifier scores the last token before the padding: it must know the pad id.
        model.config.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
    if cfg.sample_packing or (cfg.eval_sample_packing and cfg.val_set_size):  # packing that will run
        from offloadkit.data.packing import mask_packed_documents, packing_keeps_documents_apart

        apart, why = packing_keeps_documents_apart(model)
        if not apart and mask_packed_documents(model):
            apart = True  # its masks are built from the position ids, as other models build theirs
        if not apart:
            key = cfg.name("sample_packing") if cfg.sample_packing else cfg.name("eval_sample_packing")
            kernel = getattr(model.config, "_attn_implementation", None) or "its attention"
            raise ConfigError(
                f"{key}=true: {type(model).__name__} ({kernel}) does not keep packed documents apart: {why}; "
                f"set {key}: false"
            )
    return model, tokenizer, name  # type: ignore[arg-type]


def _model_kwargs(cfg: TrainConfig, source: str) -> dict:
    """from_pretrained's arguments the config sets: attention, remote code, config overrides,
    and a dequantized MXFP4 checkpoint."""
    kwargs: dict = {"local_files_only": True}
    if cfg.num_labels is not None:
        kwargs["num_labels"] = cfg.num_labels
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.trust_remote_code:
        kwargs["trust_remote_code"] = True
    if cfg.model_config:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=cfg.trust_remote_code)
        for key, value in cfg.model_config.items():
            if not hasattr(config, key):
                raise ConfigError(
                    f"{cfg.name('model_config')}: {key!r} is not a setting of {type(config).__name__}; give keys of "
                    "the model's config.json"
                )
            setattr(config, key, value)
        kwargs["config"] = config
    if cfg.model_quantization_config == "Mxfp4Config":
        import json

        try:
            with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
                method = (json.load(f).get("quantization_config") or {}).get("quant_method")
        except (OSError, ValueError):
            method = None
        if method == "mxfp4":  # otherwise the weights are stored dequantized already
            import transformers

            mxfp4 = transformers.Mxfp4Config  # type: ignore[attr-defined]
            kwargs["quantization_config"] = mxfp4(**(cfg.model_quantization_config_kwargs or {}))
    return kwargs


def _model_class(cfg: TrainConfig, source: str | None = None):
    """The class that loads the model: the config's ``model_class``; else a causal LM, or, for
    a vision-language model that has no causal-LM class (Mistral 3), its image-text-to-text
    class, whose text path then trains (as Axolotl trains its text-only configs)."""
    with needs("offloadkit train"):
        import transformers
    if cfg.model_class:
        return getattr(transformers, cfg.model_class)
    if source is not None:
        from transformers.models.auto import modeling_auto

        try:
            config = transformers.AutoConfig.from_pretrained(
                source, local_files_only=True, trust_remote_code=cfg.trust_remote_code
            )
        except (OSError, ValueError):
            return transformers.AutoModelForCausalLM  # its own error says what is missing
        if (
            type(config) not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
            and type(config) in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        ):
            return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def _pretrained(cfg: TrainConfig, source: str, **kwargs):
    """``from_pretrained`` with the model's own attention when it has no kernel of the name
    asked for (Gemma 2 runs eager attention, not sdpa): the same computation, and a warning."""
    return _with_own_attention(lambda **kw: _model_class(cfg, source).from_pretrained(source, **kw), kwargs)


def _with_own_attention(load, kwargs: dict):
    """``load(**kwargs)``, again without ``attn_implementation`` when the model has no kernel
    of that name (with a warning naming the one it uses)."""
    try:
        return load(**kwargs)
    except ValueError as exc:
        asked = kwargs.get("attn_implementation")
        if not asked or "does not support" not in str(exc) or "attention" not in str(exc).lower():
            raise
    import warnings

    model = load(**{k: v for k, v in kwargs.items() if k != "attn_implementation"})
    warnings.warn(
        f"offloadkit: {type(model).__name__} has no {asked!r} attention; it uses its own "
        f"({getattr(model.config, '_attn_implementation', 'default')})",
        UserWarning,
        stacklevel=4,
    )
    return model


def _from_pretrained(cfg: TrainConfig, source: str, dtype: torch.dtype, **extra):
    try:
        if cfg.reinit_weights:
            return _from_config(cfg, source, dtype)
        return _pretrained(cfg, source, dtype=dtype, **_model_kwargs(cfg, source), **extra)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{cfg.name('model')}={cfg.model!r} could not be loaded as a local Hugging Face model "
            f"({' '.join(str(exc).split())[:300]})"
        ) from None


def _from_config(cfg: TrainConfig, source: str, dtype: torch.dtype):
    """The model's architecture with random weights (``reinit_weights``), drawn after the seed:
    its config as the pretrained route reads it (``model_config`` overrides, ``num_labels``)."""
    import transformers

    kwargs = _model_kwargs(cfg, source)
    config = kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(
        source, local_files_only=True, trust_remote_code=cfg.trust_remote_code
    )
    if "num_labels" in kwargs:
        config.num_labels = kwargs.pop("num_labels")
    built: dict = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if "attn_implementation" in kwargs:
        built["attn_implementation"] = kwargs["attn_implementation"]
    torch.manual_seed(cfg.seed)
    # A fresh copy each try: a refused attention stays recorded in the config it was asked on.
    return _with_own_attention(lambda **kw: _model_class(cfg, source).from_config(copy.deepcopy(config), **kw), built)


def _load_tokenizer(cfg: TrainConfig):
    with needs("offloadkit train"):
        import transformers

    tokenizer_dir = cfg.tokenizer or cfg.model
    kwargs: dict = {"local_files_only": True}
    if cfg.trust_remote_code:
        kwargs["trust_remote_code"] = True
    if cfg.tokenizer_use_fast is not None:
        kwargs["use_fast"] = cfg.tokenizer_use_fast
    if cfg.tokenizer_legacy is not None:
        kwargs["legacy"] = cfg.tokenizer_legacy
    loader = getattr(transformers, cfg.tokenizer_type or "AutoTokenizer")
    try:
        tokenizer = loader.from_pretrained(tokenizer_dir, **kwargs)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"{cfg.name('tokenizer') if cfg.tokenizer else cfg.name('model')}={tokenizer_dir!r}: "
            f"the tokenizer could not be loaded ({' '.join(str(exc).split())[:300]})"
        ) from None
    if tokenizer.pad_token is None and not (cfg.special_tokens or {}).get("pad_token"):
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_quantized(cfg: TrainConfig, device: str, dtype: torch.dtype):
    """A 4-bit (QLoRA: NF4 with double quantisation) or 8-bit (LLM.int8) base computing in
    ``dtype``; the built-in model is saved once to ``output_dir/base`` and loaded from there."""
    import dataclasses

    bits = 4 if cfg.load_in_4bit else 8
    key = cfg.name("load_in_4bit") if bits == 4 else cfg.name("load_in_8bit")
    check(("bitsandbytes",), f"{key} (a {bits}-bit base)")
    with needs("offloadkit train"):
        from transformers import BitsAndBytesConfig

    plain = dataclasses.replace(cfg, load_in_4bit=False, load_in_8bit=False, sample_packing=False)
    plain.eval_sample_packing = False
    if cfg.model is None:
        model, tokenizer, name = load_model(plain, "cpu", dtype)
        source = os.path.join(cfg.output_dir, "base")
        model.save_pretrained(source)
        tokenizer.save_pretrained(source)
        del model
        plain = dataclasses.replace(plain, model=source, attn_implementation=cfg.attn_implementation or "sdpa")
    else:
        source, name = cfg.model, cfg.model
        tokenizer = _load_tokenizer(plain)
    if bits == 4:
        settings: dict = dict(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    else:
        settings = dict(load_in_8bit=True)
    settings.update(cfg.quantization_kwargs or {})
    try:
        quantization = BitsAndBytesConfig(**settings)
        model = _pretrained(
            cfg,
            source,
            dtype=dtype,
            quantization_config=quantization,
            device_map={"": device},
            **{**_model_kwargs(plain, source), "attn_implementation": plain.attn_implementation or "sdpa"},
        )
    except (OSError, ValueError, ImportError, TypeError) as exc:
        raise ConfigError(
            f"{key}=true: {source!r} could not be loaded in {bits} bits ({' '.join(str(exc).split())[:300]})"
        ) from None
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            # bitsandbytes repacks a 4-bit layer's weight for CPU inference the first time it
            # runs in eval mode without gradients (an evaluation, the packing check), and its
            # training path cannot read that layout afterwards: keep the training layout.
            module.support_avx512bf16_for_cpu = False
        if device == "cpu" and type(module).__name__ == "Linear8bitLt":
            # Its CPU inference kernel fails on some shapes; evaluation runs the layer as
            # training does (the weight dequantized), so it computes what training computes.
            module.training = True
            module.train = types.MethodType(lambda self, mode=True: self, module)  # type: ignore[method-assign]
    if cfg.quantize_moe_experts:
        from offloadkit.integrations.moe_quant import quantize_expert_parameters

        if not quantize_expert_parameters(model, cfg.quantization_kwargs or {}, bits=bits):
            raise ConfigError(
                f"{cfg.name('quantize_moe_experts')}=true: {type(model).__name__} keeps no expert weights as 3-D "
                "parameters (its experts are linear layers, quantized already); set it to false"
            )
    what = "4-bit NF4" if bits == 4 else "8-bit"
    return model, tokenizer, f"{name} ({what} base)"


# A chat template named after a model family (Axolotl's names) is that family's own format:
# it is rendered with the tokenizer's template when the model is of that family.
_TEMPLATE_FAMILIES = {
    "llama3": ("llama",),
    "llama3_2_vision": ("llama", "mllama"),
    "llama4": ("llama4",),
    "gemma": ("gemma", "gemma2", "gemma3", "gemma3n"),
    "gemma2": ("gemma2",),
    "gemma3": ("gemma3", "gemma3n"),
    "gemma3n": ("gemma3n",),
    "gemma4": ("gemma4",),
    "gemma4_unified": ("gemma4",),
    "qwen_25": ("qwen2",),
    "qwen2_vl": ("qwen2",),
    "qwen3": ("qwen3",),
    "qwen3_5": ("qwen3_5",),
    "phi_3": ("phi3",),
    "phi_35": ("phi3",),
    "phi_4": ("phi3",),
    "falcon_h1": ("falcon_h1",),
    "cohere": ("cohere", "cohere2"),
    "command_a": ("cohere",),
    "deepseek_v2": ("deepseek_v2",),
    "deepseek_v3": ("deepseek_v3",),
    "jamba": ("jamba",),
    "mistral_v1": ("mistral", "mixtral"),
    "mistral_v2v3": ("mistral", "mixtral"),
    "mistral_v3_tekken": ("mistral", "mixtral"),
    "mistral_v7_tekken": ("mistral", "mixtral", "ministral"),
    "exaone": ("exaone",),
    "granite": ("granite",),
}


def _with_template(cfg: TrainConfig, tokenizer, model=None):
    """The tokenizer with the chat template ``chat_template`` names (its own by default)."""
    from offloadkit.data.sft import CHATML_TEMPLATE

    name = cfg.chat_template
    if name == "chatml":
        tokenizer.chat_template = CHATML_TEMPLATE
    elif name and "{" in name:
        tokenizer.chat_template = name
    elif name == "tokenizer_default_fallback_chatml":
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = CHATML_TEMPLATE
    elif name and name != "tokenizer_default":
        model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "")
        families = _TEMPLATE_FAMILIES.get(name)
        key = cfg.name("chat_template")
        if families is None:
            raise ConfigError(
                f"{key}={name!r} is not a template offloadkit knows; give chat_template: jinja with "
                "chat_template_jinja (its text), tokenizer_default, or chatml"
            )
        if not any(model_type == f or model_type.startswith(f + "_") for f in families):
            raise ConfigError(
                f"{key}={name!r} is the {name} family's chat format, and this model is {model_type or 'unknown'}; give "
                "chat_template: jinja with chat_template_jinja, or the model's own (tokenizer_default)"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"{key}={name!r}: the tokenizer has no chat template of its own to render it with; give "
                "chat_template: jinja with chat_template_jinja (the template text)"
            )
    return tokenizer


def _add_tokens(cfg: TrainConfig, tokenizer, model) -> None:
    """special_tokens and tokens into the tokenizer, the embeddings grown to fit, and the
    end-of-turn tokens checked to be tokens of it."""
    before = len(tokenizer)
    if cfg.special_tokens:
        from tokenizers import AddedToken

        tokenizer.add_special_tokens(
            {
                k: AddedToken(v, rstrip=False, lstrip=False, normalized=False, special=True)
                for k, v in cfg.special_tokens.items()
            }  # type: ignore[arg-type]
        )
    if cfg.tokens:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, rstrip=False, lstrip=False, normalized=False) for t in cfg.tokens])
    for token in cfg.eot_tokens or []:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ConfigError(
                f"{cfg.name('eot_tokens')}: {token!r} is {len(ids)} tokens of this tokenizer, not one; add it with "
                "tokens: or special_tokens:, or name the tokenizer's own end-of-turn token"
            )
    grew = len(tokenizer) > before
    size = len(tokenizer)
    if cfg.resize_token_embeddings_to_32x:
        size = -(-size // 32) * 32
    embeddings = model.get_input_embeddings().weight.shape[0]
    if embeddings < size:
        model.resize_token_embeddings(size)
    if grew and cfg.lora_rank:
        trained = set(cfg.lora_modules_to_save or [])
        if not ({"embed_tokens", "lm_head"} <= trained):
            raise ConfigError(
                f"{cfg.name('special_tokens') if cfg.special_tokens else cfg.name('tokens')} adds "
                f"{len(tokenizer) - before} new tokens, whose embeddings a LoRA run would leave untrained; set "
                "lora_modules_to_save: [embed_tokens, lm_head]"
            )
    for key in ("pad_token", "eos_token", "bos_token"):
        value = (cfg.special_tokens or {}).get(key)
        if value is not None:
            setattr(model.config, f"{key}_id", tokenizer.convert_tokens_to_ids(value))
            generation = getattr(model, "generation_config", None)
            if generation is not None:
                setattr(generation, f"{key}_id", tokenizer.convert_tokens_to_ids(value))


@dataclasses.dataclass
class TrainingData:
    """What a run trains and evaluates on.

    Attributes:
        train: the training dataset (rows: blocks, examples or packed rows).
        collator: the collator of both (None: fixed-length blocks, the Trainer's default).
        notes: what the report says about the data.
        eval: the held-out dataset (``val_set_size``), else None.
        eval_collator: the held-out set's own collator.
    """

    train: Any
    collator: Any
    notes: list
    eval: Any = None
    eval_collator: Any = None


def training_data(cfg: TrainConfig, tokenizer) -> TrainingData:
    """The training (and held-out) data as ``cfg`` says: examples of each dataset, short ones
    and repeats dropped, the held-out split, then packed or padded per batch."""
    from offloadkit.data import TokenBlocks, load_texts

    if cfg.rl == "kto":
        return _kto_data(cfg, tokenizer)
    if cfg.rl:
        return _preference_data(cfg, tokenizer)
    if cfg.reward_model:
        return _reward_data(cfg, tokenizer)
    plain = not (
        cfg.sample_packing
        or cfg.val_set_size
        or cfg.min_sample_len
        or cfg.dataset_exact_deduplication
        or cfg.pad_to_sequence_len
    )
    if not cfg.datasets:
        try:
            texts = load_texts(cfg.dataset, cfg.text_field)
            if plain:
                return TrainingData(TokenBlocks(tokenizer, texts, cfg.seq_len), None, [])
            if cfg.sample_packing:
                from offloadkit.data.sft import document_examples

                examples = document_examples(tokenizer, texts, cfg.seq_len)  # packed: documents kept apart
            else:
                examples = [(row.tolist(), row.tolist()) for row in TokenBlocks(tokenizer, texts, cfg.seq_len).data]
        except ValueError as exc:
            hint = f"; use a smaller {cfg.name('seq_len')} or more text" if "fewer than one block" in str(exc) else ""
            raise ConfigError(f"{cfg.name('dataset')}: {exc}{hint}") from None
        return _finish(cfg, tokenizer, examples, [])
    from offloadkit.data.sft import build_examples

    examples, notes = [], []
    for spec in cfg.dataset_specs():
        try:
            got, dropped = build_examples(
                spec, tokenizer, cfg.seq_len, cfg.train_on_inputs, per_document=cfg.sample_packing
            )
        except ValueError as exc:
            raise ConfigError(f"{cfg.name('datasets')}: {exc}") from None
        examples += got
        if dropped:
            notes.append(f"{spec.path}: {dropped} examples longer than {cfg.name('seq_len')}={cfg.seq_len} dropped")
    return _finish(cfg, tokenizer, examples, notes)


def _finish(cfg: TrainConfig, tokenizer, examples: list, notes: list) -> TrainingData:
    import random

    from offloadkit.data.packing import PackedRows, pack_examples, packed_collate
    from offloadkit.data.sft import SFTExamples, pad_collate

    if cfg.min_sample_len:
        kept = [e for e in examples if len(e[0]) >= cfg.min_sample_len]
        if examples and not kept:
            raise ConfigError(
                f"{cfg.name('min_sample_len')}={cfg.min_sample_len}: every example is shorter (the longest has "
                f"{max(len(e[0]) for e in examples)} tokens); lower it"
            )
        if len(kept) < len(examples):
            notes.append(
                f"{len(examples) - len(kept)} examples shorter than {cfg.name('min_sample_len')}="
                f"{cfg.min_sample_len} tokens dropped"
            )
        examples = kept
    if cfg.dataset_exact_deduplication:
        seen: set = set()
        unique = []
        for ids, labels in examples:
            if (tuple(ids), tuple(labels)) not in seen:
                seen.add((tuple(ids), tuple(labels)))
                unique.append((ids, labels))
        if len(unique) < len(examples):
            notes.append(f"{len(examples) - len(unique)} repeated examples dropped")
        examples = unique
    held: list = []
    if cfg.val_set_size:
        if cfg.shuffle_merged_datasets:
            examples = list(examples)
            random.Random(cfg.seed).shuffle(examples)
        examples, held, note = _hold_out(cfg, examples, "examples")
        notes.append(note)
    if not examples:
        raise ConfigError(f"{cfg.name('datasets')}: no example left to train on")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    length = cfg.seq_len if cfg.pad_to_sequence_len else None

    def build(items: list, packed: bool):
        if packed:
            rows = pack_examples(items, cfg.seq_len, sequential=cfg.sample_packing_sequentially)
            return PackedRows(rows, len(items)), packed_collate(pad, length)
        return SFTExamples(items), pad_collate(pad, length)

    train, collator = build(examples, cfg.sample_packing)
    if cfg.sample_packing:
        notes.append(f"{len(examples)} examples packed into {len(train)} rows of up to {cfg.seq_len} tokens")
    data = TrainingData(train, collator, notes)
    if held:
        eval_packing = cfg.sample_packing if cfg.eval_sample_packing is None else cfg.eval_sample_packing
        data.eval, data.eval_collator = build(held, eval_packing)
        if eval_packing != cfg.sample_packing:
            # The Trainer has one collator: each batch goes to the one of its kind.
            packed, padded = (collator, data.eval_collator) if cfg.sample_packing else (data.eval_collator, collator)
            data.collator = lambda items: (packed if "position_ids" in items[0] else padded)(items)
    return data


def _hold_out(cfg: TrainConfig, examples: list, noun: str) -> tuple[list, list, str]:
    """``val_set_size`` (a fraction below 1, else a count) of ``examples`` held out from the end:
    ``(train, held, note)``.

    Raises:
        ConfigError: nothing would be left to train on.
    """
    import math

    size = cfg.val_set_size
    count = math.ceil(size * len(examples)) if size < 1 else int(size)
    if count >= len(examples):
        raise ConfigError(
            f"{cfg.name('val_set_size')}={size!r} holds out {count} of the {len(examples)} {noun}, leaving none "
            "to train on; lower it"
        )
    cut = len(examples) - count
    return examples[:cut], examples[cut:], f"{count} of {len(examples)} {noun} held out for evaluation"


def _read_datasets(cfg: TrainConfig, read, what: str) -> tuple[list, list]:
    """Every dataset's examples as ``read(spec, tokenizer, seq_len) -> (examples, skipped)``
    gives them, and a note per dataset that skipped some (``what``: how, e.g. "preference pairs
    longer than ... dropped")."""
    examples: list = []
    notes: list = []
    limit = f"{cfg.name('seq_len')}={cfg.seq_len}"
    for spec in cfg.dataset_specs():
        try:
            got, skipped = read(spec)
        except ValueError as exc:
            raise ConfigError(f"{cfg.name('datasets')}: {exc}") from None
        examples += got
        if skipped:
            notes.append(f"{spec.path}: {skipped} {what.format(limit=limit)}")
    return examples, notes


def _preference_data(cfg: TrainConfig, tokenizer) -> TrainingData:
    """``rl: dpo``: the preference pairs of each dataset (pairs that do not fit dropped), repeats
    dropped, shuffled and split as SFT examples are; the DPO trainer tokenizes and batches them."""
    from offloadkit.data.preference import preference_examples

    read = lambda spec: preference_examples(spec, tokenizer, cfg.seq_len)  # noqa: E731
    examples, notes = _read_datasets(cfg, read, "preference pairs longer than {limit} dropped")
    notes.append(f"DPO on {{}} preference pairs (beta {cfg.rl_beta if cfg.rl_beta is not None else 0.1})")
    return _pairs_data(cfg, examples, notes)


def _kto_data(cfg: TrainConfig, tokenizer) -> TrainingData:
    """``rl: kto``: each dataset's labelled completions (longer ones dropped), repeats dropped,
    shuffled and split as SFT examples are; TRL's KTO trainer tokenizes and batches them."""
    from offloadkit.data.preference import kto_examples

    examples, notes = _read_datasets(
        cfg, lambda spec: kto_examples(spec, tokenizer, cfg.seq_len), "examples longer than {limit} dropped"
    )
    desirable = sum(e["label"] for e in examples)
    notes.append(f"{desirable} of the {len(examples)} completions are labelled desirable")
    notes.append(f"KTO on {{}} labelled completions (beta {cfg.rl_beta if cfg.rl_beta is not None else 0.1})")
    return _pairs_data(cfg, examples, notes, "examples")


def _reward_data(cfg: TrainConfig, tokenizer) -> TrainingData:
    """``reward_model: true``: each record's chosen and rejected conversation rendered with
    the chat template and tokenized (cut at ``seq_len``), repeats dropped, shuffled and split
    as SFT examples are; TRL's reward trainer batches them."""
    from offloadkit.data.preference import reward_examples

    examples, notes = _read_datasets(
        cfg, lambda spec: reward_examples(spec, tokenizer, cfg.seq_len), "pairs with a side longer than {limit} cut"
    )
    notes.append("reward model (Bradley-Terry) on {} pairs")
    return _pairs_data(cfg, examples, notes)


def _pairs_data(cfg: TrainConfig, examples: list, notes: list, noun: str = "pairs") -> TrainingData:
    """Pairs (DPO's or a reward model's): repeats dropped, shuffled, the held-out split; the
    last note's ``{}`` becomes the number of pairs trained on."""
    import json
    import random

    import datasets

    if cfg.dataset_exact_deduplication:
        seen: set = set()
        unique = []
        for example in examples:
            key = json.dumps(example, sort_keys=True)
            if key not in seen:
                seen.add(key)
                unique.append(example)
        if len(unique) < len(examples):
            notes.insert(-1, f"{len(examples) - len(unique)} repeated {noun} dropped")
        examples = unique
    if cfg.shuffle_merged_datasets:
        random.Random(cfg.seed).shuffle(examples)
    held: list = []
    if cfg.val_set_size:
        examples, held, note = _hold_out(cfg, examples, noun)
        notes.insert(-1, note)
    notes[-1] = notes[-1].format(len(examples))
    data = TrainingData(datasets.Dataset.from_list(examples), None, notes)
    if held:
        data.eval = datasets.Dataset.from_list(held)
    return data


def schedule(cfg: TrainConfig, rows: int, world: int, planned: int, evaluating: bool) -> dict:
    """The Trainer's settings that depend on the data: ``warmup_ratio`` as steps of the
    ``planned`` ones, ``saves_per_epoch`` and ``evals_per_epoch`` as steps (steps per epoch
    from the rows), the held-out set's evaluation (once per epoch by default, or at the end
    of a shorter run)."""
    import math

    from offloadkit.integrations.axolotl import AXOLOTL_DEFAULT_WARMUP

    batch = cfg.batch_size * world
    batches = rows // batch if cfg.dataloader_drop_last else math.ceil(rows / batch)
    per_epoch = max(1, batches // cfg.gradient_accumulation_steps)
    out: dict = {}
    if cfg.warmup_ratio is not None:
        # A fraction of the run's steps, rounded down, as Axolotl counts it.
        warmup = int(cfg.warmup_ratio * planned)
        out["warmup_steps"] = min(warmup, 100) if cfg.name("warmup_ratio") == AXOLOTL_DEFAULT_WARMUP else warmup
    if cfg.saves_per_epoch:
        out.update(save_strategy="steps", save_steps=max(1, math.ceil(per_epoch / cfg.saves_per_epoch)))
    if evaluating:
        if cfg.eval_steps:
            steps = cfg.eval_steps
        elif cfg.evals_per_epoch == 0:
            steps = 0
        elif cfg.evals_per_epoch:
            steps = max(1, math.ceil(per_epoch / cfg.evals_per_epoch))
        else:
            steps = min(per_epoch, planned)
        if steps:
            out.update(eval_strategy="steps", eval_steps=steps)
    return out


def training_args(cfg: TrainConfig, cuda: bool, **overrides):
    """The Trainer's arguments for ``cfg`` (``overrides`` replace any)."""
    with needs("offloadkit train"):
        from transformers import TrainingArguments

    from offloadkit.integrations.hf_args import checkpointing_requested, set_checkpointing

    reporters = [cfg.report_to] if isinstance(cfg.report_to, str) else list(cfg.report_to)
    reporters = [r for r in reporters if r != "none"]
    kwargs = dict(
        output_dir=cfg.output_dir,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.eval_batch_size or cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_steps=cfg.max_steps or -1,
        num_train_epochs=cfg.num_epochs or 1.0,
        learning_rate=cfg.learning_rate,
        # A float below 1 is a fraction of the run's steps (transformers' warmup ratio).
        warmup_steps=cfg.warmup_ratio if cfg.warmup_ratio is not None else cfg.warmup_steps,
        lr_scheduler_type=cfg.lr_scheduler,
        optim=cfg.optimizer,
        logging_steps=cfg.logging_steps,
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or 500,
        save_total_limit=cfg.save_total_limit,
        save_only_model=cfg.save_only_model,
        report_to=reporters or "none",
        disable_tqdm=True,
        seed=cfg.seed,
        remove_unused_columns=False,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        fp16=cfg.dtype == "float16",
        logging_nan_inf_filter=False,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        neftune_noise_alpha=cfg.neftune_noise_alpha,
        dataloader_drop_last=cfg.dataloader_drop_last,
        eval_strategy="no",
    )
    for key in ("adam_beta1", "adam_beta2", "adam_epsilon"):
        if getattr(cfg, key) is not None:
            kwargs[key] = getattr(cfg, key)
    if cfg.cosine_min_lr_ratio is not None and not cfg.lr_quadratic_warmup:  # Axolotl's quadratic warmup wins
        # Cosine down to a fraction of the learning rate: the Trainer's cosine_with_min_lr.
        kwargs.update(
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": cfg.cosine_min_lr_ratio}
        )
    if cfg.group_by_length:
        kwargs["train_sampling_strategy"] = "group_by_length"
    elif cfg.curriculum_sampling:
        kwargs["train_sampling_strategy"] = "sequential"
    if cfg.tf32 is not None and cuda:
        kwargs["tf32"] = cfg.tf32
    if cfg.early_stopping_patience:
        # Early stopping watches the evaluation loss; the best checkpoint's weights end the run.
        kwargs.update(metric_for_best_model="eval_loss", greater_is_better=False)
    arguments = TrainingArguments
    # TRL's argument classes default to what would override the config's own: checkpointing is
    # offloadkit's (the mixin's) to switch on, and the weights' dtype is the config's.
    trl_defaults = dict(gradient_checkpointing=False, bf16=False)
    if cfg.reward_model:
        from trl import RewardConfig

        arguments = RewardConfig
        kwargs.update(
            center_rewards_coefficient=cfg.center_rewards_coefficient,
            max_length=None,  # the pairs are cut at seq_len already, as Axolotl cuts them
            pad_to_multiple_of=cfg.seq_len if cfg.pad_to_sequence_len else None,
            **trl_defaults,
        )
    if cfg.rl in ("dpo", "kto"):
        from trl import DPOConfig, KTOConfig

        arguments = KTOConfig if cfg.rl == "kto" else DPOConfig
        kwargs.update(beta=cfg.rl_beta if cfg.rl_beta is not None else 0.1, max_length=cfg.seq_len, **trl_defaults)
        for key in ("desirable_weight", "undesirable_weight") if cfg.rl == "kto" else ():
            if getattr(cfg, f"kto_{key}") is not None:
                kwargs[key] = getattr(cfg, f"kto_{key}")
    kwargs.update(overrides)
    if cfg.early_stopping_patience and kwargs.get("eval_strategy") == kwargs.get("save_strategy") == "steps":
        kwargs["load_best_model_at_end"] = True
    args = arguments(**kwargs)  # type: ignore[arg-type]  # values checked by TrainConfig
    if cfg.gradient_checkpointing_kwargs:
        set_checkpointing(args, checkpointing_requested(args), cfg.gradient_checkpointing_kwargs)
    return args


def quiet(trainer):
    """``trainer`` without its printing and progress callbacks (the CLI shows its own)."""
    with needs("offloadkit train"):
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    return trainer


def with_lora(cfg: TrainConfig, model):
    """``model`` with the LoRA adapters ``cfg`` asks for (``lora_rank`` > 0): new ones, or
    those saved in ``lora_model_dir``, trained further."""
    from offloadkit.integrations.peft_utils import apply_lora, load_lora

    if cfg.lora_model_dir:
        return load_lora(model, cfg.lora_model_dir)
    try:
        return _apply_lora(cfg, model, apply_lora)
    except ValueError as exc:
        message = " ".join(str(exc).split())
        if "lora_dropout" in message:
            # PEFT puts LoRA on a mixture-of-experts layer's expert parameters (ParamWrapper),
            # which takes no dropout.
            raise ConfigError(
                f"{cfg.name('lora_dropout')}={cfg.lora_dropout}: PEFT cannot apply dropout to the LoRA of "
                f"{type(model).__name__}'s expert parameters ({message[:120]}); set lora_dropout: 0, or target "
                "other modules"
            ) from None
        key = cfg.name("lora_target_modules") if "arget module" in message else cfg.name("lora_rank")
        raise ConfigError(f"{key}: PEFT could not add the LoRA adapters ({message[:200]})") from None


def _apply_lora(cfg: TrainConfig, model, apply_lora):
    return apply_lora(
        model,
        rank=cfg.lora_rank,
        alpha=cfg.lora_alpha,
        target_modules=cfg.lora_target_modules,
        dropout=cfg.lora_dropout,
        modules_to_save=cfg.lora_modules_to_save,
        use_dora=cfg.lora_use_dora,
        use_rslora=cfg.lora_use_rslora,
        fan_in_fan_out=cfg.lora_fan_in_fan_out,
        target_parameters=cfg.lora_target_parameters,
    )


def trainable(cfg: TrainConfig, model):
    """``model`` (with its adapters) with only the parameters ``unfrozen_parameters`` names
    left trainable: each pattern matched from the start of a parameter's name, a dot as a
    dot, as Axolotl reads them."""
    import re

    if not cfg.unfrozen_parameters:
        return model
    patterns = [re.compile(re.sub(r"\.(?!\+)", r"\\.", p)) for p in cfg.unfrozen_parameters]
    kept = 0
    for name, param in model.named_parameters():
        param.requires_grad = any(p.match(name) for p in patterns)
        kept += param.requires_grad
    if not kept:
        first = next(iter(dict(model.named_parameters())), "")
        raise ConfigError(
            f"{cfg.name('unfrozen_parameters')}={cfg.unfrozen_parameters!r} matches no parameter of the model "
            f"(names like {first!r}), so nothing would train; match its names from the start"
        )
    if any(("embed_tokens" in p or "lm_head" in p) for p in cfg.unfrozen_parameters):
        model.enable_input_require_grads()
    return model
