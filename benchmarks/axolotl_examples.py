"""Axolotl's example configs through ``offloadkit check`` and a 2-step ``offloadkit train``.

    python benchmarks/axolotl_examples.py AXOLOTL --out benchmarks/results/axolotl-examples
    python benchmarks/axolotl_examples.py AXOLOTL --only examples/llama-3/lora-1b.yml --keep /tmp/work

``AXOLOTL`` is a checkout of Axolotl or its bare git directory (the configs are read from
``HEAD:examples/``); they are extracted to a temporary folder first.

Check: ``offloadkit check CONFIG`` on each config as written, in a process of its own, with
``HF_HUB_OFFLINE=1`` (nothing downloads): no traceback, every problem on one line, and the
wall time of each (the command's start included), one at a time before any training run.

Train: ``offloadkit train`` for 2 steps of each config with a base_model, in a process of its
own, with no key dropped. What is replaced, and only that:

- ``base_model`` (and ``tokenizer_config``): a tiny random-weight model of the same
  architecture (the named model's ``model_type``, built from transformers' config class with
  small sizes, wide enough for a ``qat`` group size and deep enough for ``lisa_n_layers``, no
  download) and a byte-level stand-in tokenizer (of Llama's class when the config names
  LlamaTokenizer or CodeLlamaTokenizer) that has the config's special and end-of-turn tokens
  and a chat template in the model family's format;
- each dataset's ``path`` (a hub id): a local file of 1000 records in the format its
  ``type`` reads (alpaca, jeopardy, chat_template with the entry's field names, its preference
  pairs with field_chosen and field_rejected, bradley_terry's reward pairs, UltraFeedback's
  labelled completions and pairs, completion), without
  the hub-only keys ``data_files``, ``name`` and ``revision``;
- the run's size: ``max_steps: 2``, ``sequence_len`` at most 512 (``min_sample_len`` at most
  a quarter of it), ``micro_batch_size`` and ``gradient_accumulation_steps`` at most 2
  (``batch_size`` follows them), ``output_dir`` a temporary folder, ``compare: false``.

Each config ends as ``trained`` (exit 0, 2 steps), ``refused`` (exit 2 with one
``offloadkit: error:`` line, naming the key or feature), ``no stand-in`` (its architecture
is not in the installed transformers: a model's own code, or a package transformers needs
for it) or ``failed`` (anything else: a bug to fix). Results go to ``--out``:
``results.tsv`` (one row per config) and ``summary.md`` (counts, reasons, the command and the
versions).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = 1000
_BUILDING = threading.Lock()  # transformers' lazy imports are not safe from two threads at once

# The named model -> its transformers model_type (None: multimodal or not a transformers
# architecture; such configs are refused by their keys, or have no stand-in).
MODEL_TYPES = (
    (r"Llama-4|llama-4", "llama4"),
    (r"Llama-3\.2-11B-Vision", None),
    (r"Sparse-Llama|llama|Llama|TinyLlama|open_llama|CodeLlama|Yi-34B|xgen|orpheus", "llama"),
    (r"Mixtral", "mixtral"),
    (r"Mistral-Small-4|Mistral-Medium-3\.5|Magistral-Small-2509|Mistral-Small-3\.1|pixtral", "mistral3"),
    (r"Ministral-3-", "ministral3"),
    (r"Mistral|Magistral|Devstral|Ministral-8B", "mistral"),
    (r"Voxtral", None),
    (r"Qwen3\.5-[\d.]+B-A\d+B", "qwen3_5_moe"),
    (r"Qwen3\.5", "qwen3_5"),
    (r"Qwen3-Next", "qwen3_next"),
    (r"Qwen3-\d+B-A\d+B", "qwen3_moe"),
    (r"Qwen2(\.5)?-VL|Qwen2-VL", None),
    (r"Qwen3|Plano-Orchestrator", "qwen3"),
    (r"Qwen1\.5-MoE", "qwen2_moe"),
    (r"Qwen2|DeepCoder|cogito-v1-preview-qwen", "qwen2"),
    (r"Qwen/Qwen-7B", "qwen"),
    (r"gemma-3n", "gemma3n"),
    (r"[Gg]emma-4", "gemma4"),
    (r"gemma-3-(1b|270m)", "gemma3_text"),
    (r"gemma-3-", "gemma3"),
    (r"gemma-2", "gemma2"),
    (r"gemma", "gemma"),
    (r"Phi-3", "phi3"),
    (r"phi-1_5|phi-2", "phi"),
    (r"gpt-j", "gptj"),
    (r"pythia|RedPajama", "gpt_neox"),
    (r"Cerebras-GPT", "gpt2"),
    (r"btlm", "btlm"),
    (r"replit", "mpt_replit"),
    (r"mpt-7b", "mpt"),
    (r"stablelm", "stablelm"),
    (r"starcoder2", "starcoder2"),
    (r"Falcon-H1", "falcon_h1"),
    (r"Falcon-E", "bitnet"),
    (r"falcon", "falcon"),
    (r"Jamba", "jamba"),
    (r"mamba", "mamba"),
    (r"LFM2-VL", None),
    (r"LFM2-\d+B-A\d+B", "lfm2_moe"),
    (r"LFM2", "lfm2"),
    (r"dbrx", "dbrx"),
    (r"DeepSeek-V2", "deepseek_v2"),
    (r"DeepSeek-V4", "deepseek_v4"),
    (r"gpt-oss", "gpt_oss"),
    (r"GLM-4-\d+B", "glm4"),
    (r"GLM-4\.5-Air", "glm4_moe"),
    (r"GLM-4\.7-Flash", "glm4_moe_lite"),
    (r"GLM-4\.6V|GLM-5", None),
    (r"granite-4\.0", "granitemoehybrid"),
    (r"Hunyuan", "hunyuan_v1_dense"),
    (r"Apertus", "apertus"),
    (r"AFM-4\.5B", "arcee"),
    (r"Trinity", "afmoe"),
    (r"command-r7b", "cohere2"),
    (r"Olmo-3", "olmo3"),
    (r"Seed-OSS", "seed_oss"),
    (r"Nemotron-Mini", "nemotron"),
    (r"Nemotron-3", "nemotron_h"),
    (r"MiniMax-M2", "minimax_m2"),
    (r"Kimi-Linear", "kimi_linear"),
    (r"MiMo", "mimo"),
    (r"llava|SmolVLM|InternVL|PaddleOCR", None),
)
_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
)
_MOE = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    n_shared_experts=1,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    decoder_sparse_step=1,
    shared_expert_intermediate_size=64,
)
_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
# Sizes a family names otherwise, or needs beyond the common ones.
_FAMILY_SIZES: dict = {
    "gptj": dict(rotary_dim=8),
    "falcon": dict(head_dim=None),
    "deepseek_v2": dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "glm4_moe_lite": dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "dbrx": dict(
        d_model=64,
        n_heads=4,
        n_layers=2,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2),
    ),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "gemma3": dict(_vision=_VISION, _top=dict(mm_tokens_per_image=4)),
    "gemma4": dict(_vision=_VISION, vocab_size_per_layer_input=None, hidden_size_per_layer_input=16, sliding_window=16),
}
for _mla in ("deepseek_v2", "glm4_moe_lite"):
    _FAMILY_SIZES[_mla]["num_key_value_heads"] = 4


def _turns(start: str, end: str, generation: str) -> str:
    return (
        "{% for message in messages %}" + start + "{{ message['content'] }}" + end + "{% endfor %}"
        "{% if add_generation_prompt %}" + generation + "{% endif %}"
    )


# Chat formats of the families, for the stand-in tokenizer (which imitates the family's).
_ROLE = "{{ message['role'] }}"
TEMPLATES = {
    "chatml": _turns("<|im_start|>" + _ROLE + "\n", "<|im_end|>\n", "<|im_start|>assistant\n"),
    "llama3": _turns(
        "<|start_header_id|>" + _ROLE + "<|end_header_id|>\n\n",
        "<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "llama4": _turns(
        "<|header_start|>" + _ROLE + "<|header_end|>\n\n", "<|eot|>", "<|header_start|>assistant<|header_end|>\n\n"
    ),
    "gemma": _turns(
        "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n",
        "<end_of_turn>\n",
        "<start_of_turn>model\n",
    ),
    "gemma4": _turns(
        "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n", "<turn|>\n", "<|turn>model\n"
    ),
    "phi3": _turns("<|" + _ROLE + "|>\n", "<|end|>\n", "<|assistant|>\n"),
    "harmony": _turns("<|start|>" + _ROLE + "<|message|>", "<|end|>", "<|start|>assistant<|message|>"),
    "cohere": _turns(
        "<|START_OF_TURN_TOKEN|><|{{ 'CHATBOT' if message['role'] == 'assistant' else message['role'] | upper }}"
        "_TOKEN|>",
        "<|END_OF_TURN_TOKEN|>",
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    ),
}
_MARKERS = re.compile(r"<\|[^|>]*\|>|<\|[a-z_]+>|<[a-z_]+\|>|<(?:start|end)_of_turn>")
_FAMILY_TEMPLATE = {
    "llama": "llama3",
    "llama4": "llama4",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3_text": "gemma",
    "gemma3n": "gemma",
    "gemma4": "gemma4",
    "phi3": "phi3",
    "cohere2": "cohere",
    "gpt_oss": "harmony",
}


def model_type(base_model: str) -> str | None:
    for pattern, kind in MODEL_TYPES:
        if re.search(pattern, str(base_model)):
            return kind
    return None


def tiny_config(kind: str, vocab: int, width: int | None = None):
    """A small config of ``kind`` from transformers' config class (raises when it has none);
    ``width``: every linear layer's input a multiple of it (a QAT config's group size)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[kind]
    sizes = dict(_SIZES, vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if width and width > _SIZES["hidden_size"]:
        heads = _SIZES["num_attention_heads"]
        sizes.update(hidden_size=width, intermediate_size=width, head_dim=width // heads)
    sizes.update(_MOE)
    extra = dict(_FAMILY_SIZES.get(kind, {}))
    vision, top = extra.pop("_vision", None), extra.pop("_top", {})
    sizes.update(extra)
    if "vocab_size_per_layer_input" in sizes:
        sizes["vocab_size_per_layer_input"] = vocab
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if "text_config" in (getattr(cls, "sub_configs", None) or {}):
        args = dict(text_config=sizes, **top)
        if vision is not None:
            args["vision_config"] = vision
        return cls(**args)
    return cls(**sizes)


def stand_in_tokenizer(config: dict, kind: str):
    """The byte-level stand-in tokenizer: Llama's class when the config names it, the config's
    special and end-of-turn tokens and the family's chat format as special tokens."""
    from tokenizers import AddedToken

    from offloadkit.data import byte_tokenizer

    if str(config.get("tokenizer_type") or "") in ("LlamaTokenizer", "CodeLlamaTokenizer", "LlamaTokenizerFast"):
        import transformers

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
        vocab["\u2581"] = len(vocab)
        tokenizer = transformers.LlamaTokenizer(vocab=vocab, merges=[])
        tokenizer.chat_template = TEMPLATES["chatml"]
    else:
        tokenizer = byte_tokenizer()
    template = TEMPLATES[_FAMILY_TEMPLATE.get(kind, "chatml")]
    tokenizer.chat_template = template
    specials = set(_MARKERS.findall(template))
    specials |= {v for v in (config.get("special_tokens") or {}).values() if isinstance(v, str)}
    specials |= {t for t in (config.get("eot_tokens") or []) if isinstance(t, str)}
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, normalized=False, special=True) for t in sorted(specials)]}
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stand_in(config: dict, kind: str, folder: str) -> str:
    """A tiny random model of ``kind`` and its stand-in tokenizer, saved in ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = stand_in_tokenizer(config, kind)
    vocab = -(-len(tokenizer) // 64) * 64
    qat = config.get("qat") if isinstance(config.get("qat"), dict) else {}
    model_config = tiny_config(kind, vocab, qat.get("group_size"))
    lisa = config.get("lisa_n_layers")
    if isinstance(lisa, int) and lisa > getattr(model_config, "num_hidden_layers", lisa):
        model_config.num_hidden_layers = lisa  # deep enough for LISA's sampled layers
    torch.manual_seed(0)
    from transformers.models.auto import modeling_auto

    causal = type(model_config) in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    if not causal and type(model_config) in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        from transformers import AutoModelForImageTextToText  # a vision-language model without a causal LM

        model = AutoModelForImageTextToText.from_config(model_config)
    else:
        model = AutoModelForCausalLM.from_config(model_config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _records(entry: dict) -> list:
    kind = str(entry.get("type") or "completion")
    if kind.startswith("alpaca"):
        return [
            {"instruction": f"Add {i} and {i % 7}.", "input": "" if i % 3 else "numbers", "output": f"{i + i % 7}"}
            for i in range(RECORDS)
        ]
    if kind.endswith(".ultra"):  # UltraFeedback's layouts: KTO's labelled completions, DPO's pairs
        return [
            {
                "system": "" if i % 2 else "Answer briefly.",
                "prompt": f"What is {i} plus {i}?",
                "completion": f"{2 * i if i % 3 else i}.",
                "label": bool(i % 3),
                "chosen": f"{2 * i}.",
                "rejected": f"{i}.",
            }
            for i in range(RECORDS)
        ]
    if kind.startswith("bradley_terry"):
        return [
            {"system": "Answer briefly.", "input": f"What is {i} plus {i}?", "chosen": f"{2 * i}.", "rejected": f"{i}."}
            for i in range(RECORDS)
        ]
    if kind.startswith("jeopardy"):
        return [
            {"question": f"This number is {i} doubled.", "category": "SUMS", "answer": f"{2 * i}"}
            for i in range(RECORDS)
        ]
    if kind.startswith("chat_template"):
        mappings = entry.get("message_property_mappings") or {}
        role_key = mappings.get("role", entry.get("message_field_role") or "role")
        content_key = mappings.get("content", entry.get("message_field_content") or "content")
        roles = entry.get("roles") or {}
        thinking = entry.get("field_thinking")

        def name(role):
            aliases = roles.get(role)
            return (aliases if isinstance(aliases, str) else aliases[0]) if aliases else role

        def assistant(i):
            message = {role_key: name("assistant"), content_key: f"{2 * i}."}
            if thinking:
                message[thinking] = f"{i} and {i} make {2 * i}"
            return message

        field = entry.get("field_messages") or "messages"
        if "field_chosen" in entry or "field_rejected" in entry:
            # Preference pairs: the conversation up to the question, a right and a wrong answer.
            return [
                {
                    field: [
                        {role_key: name("system"), content_key: "Answer briefly."},
                        {role_key: name("user"), content_key: f"What is {i} plus {i}?"},
                    ],
                    entry.get("field_chosen") or "chosen": {role_key: name("assistant"), content_key: f"{2 * i}."},
                    entry.get("field_rejected") or "rejected": {
                        role_key: name("assistant"),
                        content_key: f"{2 * i + 1}.",
                    },
                }
                for i in range(RECORDS)
            ]
        return [
            {
                field: [
                    {role_key: name("system"), content_key: "Answer briefly."},
                    {role_key: name("user"), content_key: f"What is {i} plus {i}?"},
                    assistant(i),
                ]
            }
            for i in range(RECORDS)
        ]
    field = entry.get("field") or entry.get("text_column") or "text"
    return [
        {field: f"Document {i}. " + "First Citizen: Before we proceed any further, hear me speak. " * (1 + i % 4)}
        for i in range(RECORDS)
    ]


def localise(config: dict, model_dir: str, folder: str) -> dict:
    """The config with the stand-in model, local datasets and the run's size (see above)."""
    config = dict(config)
    config["base_model"] = model_dir
    if config.get("tokenizer_config"):
        config["tokenizer_config"] = model_dir
    config["output_dir"] = os.path.join(folder, "out")
    for key in ("datasets", "pretraining_dataset"):
        entries = config.get(key)
        if not isinstance(entries, list):
            continue
        local = []
        for k, entry in enumerate(entries):
            if not isinstance(entry, dict):
                local.append(entry)
                continue
            path = os.path.join(folder, f"{key}-{k}.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                for record in _records(entry):
                    f.write(json.dumps(record) + "\n")
            entry = {name: v for name, v in entry.items() if name not in ("data_files", "name", "revision")}
            local.append(dict(entry, path=path))
        config[key] = local
    config["max_steps"] = 2
    config["sequence_len"] = min(int(config.get("sequence_len") or 512), 512)
    if config.get("min_sample_len"):
        config["min_sample_len"] = min(int(config["min_sample_len"]), config["sequence_len"] // 4)
    micro = min(int(config.get("micro_batch_size") or 1), 2)
    accumulation = min(int(config.get("gradient_accumulation_steps") or 1), 2)
    config["micro_batch_size"], config["gradient_accumulation_steps"] = micro, accumulation
    if config.get("batch_size"):
        config["batch_size"] = micro * accumulation
    config["compare"] = False
    return config


def extract(source: str, folder: str, only: list[str]) -> list[str]:
    """Axolotl's example configs (``HEAD:examples/**.yml``) written under ``folder``."""
    git = ["git", "--git-dir", source] if not os.path.isdir(os.path.join(source, ".git")) else ["git", "-C", source]
    names = subprocess.run(git + ["ls-tree", "-r", "HEAD", "--name-only"], capture_output=True, text=True, check=True)
    paths = [p for p in names.stdout.splitlines() if re.match(r"^examples/.*\.ya?ml$", p)]
    if only:
        paths = [p for p in paths if p in only]
    for path in paths:
        text = subprocess.run(git + ["show", f"HEAD:{path}"], capture_output=True, check=True).stdout
        os.makedirs(os.path.join(folder, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(folder, path), "wb") as f:
            f.write(text)
    return sorted(paths)


def _env() -> dict:
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def check_one(folder: str, rel: str) -> dict:
    """``offloadkit check`` on one config as written."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "offloadkit", "check", rel],
        capture_output=True,
        text=True,
        cwd=folder,
        env=_env(),
        timeout=120,
    )
    seconds = time.perf_counter() - start
    lines = proc.stdout.splitlines()
    return {
        "check_seconds": round(seconds, 2),
        "check_verdict": lines[-1][len(rel) + 2 :] if lines else "(no output)",
        "check_problems": [line[len(rel) + 2 :] for line in lines[:-1]],
        "check_traceback": "Traceback" in proc.stdout + proc.stderr,
        "check_lines_ok": all(line.startswith(f"{rel}: ") for line in lines),
    }


def _reason(line: str) -> str:
    """The key or feature a refusal names (its first ``key=`` or ``key:``)."""
    text = re.sub(r"^offloadkit: error: ", "", line)
    text = re.sub(r"^\S+\.ya?ml: (\d+ problems: \(1\) )?", "", text)
    text = re.sub(r"^preflight: (\d+ problems: \(1\) )?", "", text)
    m = re.match(r"([\w.\[\]]+)(?:=|: |\s)", text)
    return m.group(1) if m else text[:40]


def train_one(folder: str, rel: str, work: str) -> dict:
    """2 steps of one config on its stand-in (see the module docstring)."""
    import yaml

    with open(os.path.join(folder, rel), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict) or "base_model" not in config:
        return {"train": "skipped", "reason": "no base_model (not a training config)"}
    kind = model_type(config["base_model"])
    run = os.path.join(work, re.sub(r"[^\w.-]", "_", rel))
    shutil.rmtree(run, ignore_errors=True)
    os.makedirs(run)
    model_dir = os.path.join(run, "model")
    try:
        if kind is None:
            raise KeyError("multimodal")
        with _BUILDING:
            stand_in(config, kind, model_dir)
    except Exception as exc:  # the architecture is not in transformers, or needs another package
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        if kind is None:
            why = f"{config['base_model']} is not a causal LM architecture of transformers"
        local = None
    else:
        why = None
        local = localise(config, model_dir, run)
    if local is None:
        # Without a stand-in the config is still read: a refusal by its keys comes first.
        local = localise(config, os.path.join(run, "no-model"), run)
    path = os.path.join(run, "config.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(local, f, sort_keys=False)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "offloadkit", "train", path],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=900,
            cwd=run,
        )
    except subprocess.TimeoutExpired:
        return {"train": "failed", "reason": "timed out after 900 s", "train_seconds": 900}
    seconds = round(time.perf_counter() - start, 1)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("offloadkit: error:")]
    result: dict = {"train_seconds": seconds}
    if proc.returncode == 0:
        with open(os.path.join(run, "out", "report.json"), encoding="utf-8") as f:
            report = json.load(f)
        result.update(train="trained", reason="", steps=report.get("steps"), model=report.get("model"))
        result["notes"] = [n for n in report.get("notes", []) if "do not change the training" not in n]
    elif proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr:
        if why is not None and "no-model" in errors[0]:
            result.update(train="no stand-in", reason=why)
        else:
            result.update(train="refused", reason=errors[0][len("offloadkit: error: ") :], key=_reason(errors[0]))
    else:
        tail = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
        result.update(train="failed", reason=" | ".join(tail)[-400:], exit=proc.returncode)
    if why is not None and result["train"] == "failed":
        result.update(train="no stand-in", reason=why)
    if result["train"] in ("trained", "refused"):
        shutil.rmtree(run, ignore_errors=True)
    return result


def _versions() -> dict:
    import torch
    import transformers

    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(
        ["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return {
        "offloadkit_commit": commit.stdout.strip() + (" (with uncommitted changes)" if changed.stdout.strip() else ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _median(values: list) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def summarise(rows: list[dict], header: dict) -> str:
    trainable = [r for r in rows if r.get("train") not in (None, "skipped")]
    counts = collections.Counter(r["train"] for r in trainable)
    checked = [r for r in rows if "check_seconds" in r]
    slow = [r for r in checked if r["check_seconds"] >= 10]
    traced = [r for r in checked if r["check_traceback"] or not r["check_lines_ok"]]
    reasons = collections.Counter(r.get("key") or r["reason"][:60] for r in trainable if r["train"] == "refused")
    lines = [
        "# Axolotl's example configs: offloadkit check and a 2-step offloadkit train",
        "",
        f"- command: `{header['command']}`",
        f"- Axolotl: {header['axolotl']}",
        f"- offloadkit commit {header['offloadkit_commit']}, torch {header['torch']}, transformers "
        f"{header['transformers']}, {header['machine']}, {header['date']}",
        "- what the train runs replace: see `benchmarks/axolotl_examples.py` (the stand-in model and tokenizer,"
        " the datasets' paths, the run's size); no key is dropped",
        "",
        "## offloadkit check (each config as written, HF_HUB_OFFLINE=1)",
        "",
        f"{len(checked)} configs checked: {sum(r['check_verdict'] == 'ok' for r in checked)} ok, "
        f"{sum(r['check_verdict'] != 'ok' for r in checked)} with problems (one line each); "
        f"{len(traced)} with a traceback or a line not naming the config; {len(slow)} took 10 s or more "
        f"(median {_median([r['check_seconds'] for r in checked]):.1f} s, slowest "
        f"{max((r['check_seconds'] for r in checked), default=0):.1f} s, the command's start included).",
        "",
        "## offloadkit train, 2 steps on a tiny stand-in of the same architecture",
        "",
        f"{len(trainable)} configs with a base_model: **{counts['trained']} trained**, {counts['refused']} refused "
        f"with one line naming the key or feature, {counts['no stand-in']} without a stand-in, {counts['failed']} "
        "failed.",
        "",
        "Refused, by the key or feature named:",
        "",
        "| key | configs |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in reasons.most_common()]
    for kind in ("no stand-in", "failed"):
        shown = [r for r in trainable if r["train"] == kind]
        if shown:
            lines += ["", f"{kind.capitalize()}:", ""]
            lines += [f"- {r['config']}: {r['reason']}" for r in shown]
    lines += ["", "Per config: `results.tsv` (config, check verdict and seconds, train outcome, reason)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("axolotl", help="an Axolotl checkout or its bare git directory")
    parser.add_argument("--out", default=None, help="folder for results.tsv and summary.md")
    parser.add_argument("--only", action="append", default=[], help="only this config (examples/...); repeatable")
    parser.add_argument("--jobs", type=int, default=2, help="training runs at once (default 2)")
    parser.add_argument(
        "--check-jobs", type=int, default=1, help="checks at once (default 1: each timed on an otherwise idle machine)"
    )
    parser.add_argument("--no-check", action="store_true", help="skip offloadkit check")
    parser.add_argument("--no-train", action="store_true", help="skip the training runs")
    parser.add_argument("--keep", default=None, help="keep the work folder (configs, stand-ins) here")
    args = parser.parse_args(argv)
    versions = _versions()  # of the tree the runs use, before they start
    work = args.keep or tempfile.mkdtemp(prefix="offloadkit-axolotl-")
    folder = os.path.join(work, "axolotl")
    configs = extract(args.axolotl, folder, args.only)
    rows = {rel: {"config": rel} for rel in configs}
    # The checks first, alone (their times are the point), then the training runs.
    for stage, jobs_at_once, run in (
        ("check", args.check_jobs, None if args.no_check else lambda rel: check_one(folder, rel)),
        ("train", args.jobs, None if args.no_train else lambda rel: train_one(folder, rel, os.path.join(work, "runs"))),
    ):
        if run is None:
            continue
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs_at_once)) as pool:
            for rel, job in [(rel, pool.submit(run, rel)) for rel in configs]:
                try:
                    rows[rel].update(job.result())
                except Exception as exc:  # noqa: BLE001 - the harness's own failure, recorded
                    rows[rel].update({stage: "failed", "reason": f"harness: {type(exc).__name__}: {exc}"})
                row = rows[rel]
                shown = row.get("check_verdict", "-") if stage == "check" else row.get("train", "-")
                print(f"{stage} {str(shown)[:14]:14} {rel} {str(row.get('reason', ''))[:150]}", flush=True)
    git_dir = (
        args.axolotl if not os.path.isdir(os.path.join(args.axolotl, ".git")) else os.path.join(args.axolotl, ".git")
    )
    head = subprocess.run(
        ["git", "--git-dir", git_dir, "rev-parse", "--short=9", "HEAD"], capture_output=True, text=True
    )
    header = dict(
        versions,
        command="python benchmarks/axolotl_examples.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        axolotl=f"github.com/axolotl-ai-cloud/axolotl at {head.stdout.strip()} ({len(configs)} example configs)",
        machine=f"CPU only, {os.cpu_count()} cores",
        date=datetime.date.today().isoformat(),
    )
    text = summarise(list(rows.values()), header)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
            f.write(text)
        with open(os.path.join(args.out, "results.tsv"), "w", encoding="utf-8") as f:
            f.write("config\tcheck_verdict\tcheck_seconds\ttrain\treason\n")
            for row in rows.values():
                reason = " ".join(str(row.get("reason", "")).split())
                f.write(
                    f"{row['config']}\t{row.get('check_verdict', '')}\t{row.get('check_seconds', '')}\t"
                    f"{row.get('train', '')}\t{reason}\n"
                )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r for r in rows.values() if r.get("train") == "failed" or r.get("check_traceback")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
