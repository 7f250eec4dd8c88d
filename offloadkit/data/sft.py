"""Supervised fine-tuning examples from local records: completion text, Alpaca
instruction records and chat conversations rendered with the tokenizer's chat template,
with the loss only on the tokens the format trains (the response, the assistant's turns).

A dataset is described by a :class:`DatasetSpec` (the keys of an Axolotl ``datasets:``
entry that offloadkit reads). Examples longer than ``seq_len`` are dropped, as Axolotl
does; batches are padded by :func:`pad_collate`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass

import torch

from offloadkit.data.text import FORMATS, TokenBlocks, load_texts, read_text

__all__ = [
    "DatasetSpec",
    "split_bounds",
    "select_records",
    "document_examples",
    "SFT_TYPES",
    "load_records",
    "build_examples",
    "SFTExamples",
    "pad_collate",
    "CHATML_TEMPLATE",
    "PROMPT_STYLES",
]

SFT_TYPES = ("completion", "alpaca", "jeopardy", "chat_template", "bradley_terry", "kto")
# kto data's prompt formats (Axolotl's llama3.ultra and chatml.ultra): (system turn, user turn
# with the assistant's header, end of the completion).
KTO_STYLES = {
    "llama3": (
        "<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>",
        "<|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
    ),
    "chatml": (
        "<|im_start|>system\n{system}<|im_end|>\n",
        "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
        "<|im_end|>",
    ),
}
IGNORE = -100
# Instruction prompts as Axolotl renders them: a system line, then the turn with or without
# an input, in one of its prompt styles (``alpaca`` is "instruct"; ``alpaca:chat`` "chat", ...).
_SYSTEM_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request."
)
_SYSTEM = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
PROMPT_STYLES = {
    # style: (system line, turn with an input, turn without one)
    "instruct": (
        "{system}\n\n",
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "### Instruction:\n{instruction}\n\n### Response:\n",
    ),
    "chat": ("SYSTEM: {system}\n", "USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:"),
    "chatml": (
        "<|im_start|>system\n{system}<|im_end|>\n",
        "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n",
    ),
    "phi": (
        "<|system|>\n{system}<|end|>\n",
        "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
        "<|user|>\n{instruction}<|end|>\n<|assistant|>\n",
    ),
}
# ChatML, for tokenizers without a template of their own (the built-in byte tokenizer).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
# Role names of common chat datasets (ShareGPT's human/gpt) onto the template's.
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}


@dataclass
class DatasetSpec:
    """One local dataset file and how to read it.

    Attributes:
        path: a local ``.jsonl``/``.json`` file (``.txt`` for completion).
        type: "completion" (one text field), "alpaca" (instruction, input, output), "jeopardy"
            (question, category, answer: Axolotl's Jeopardy records in the alpaca prompt),
            "bradley_terry" (a reward model's system, input, chosen and rejected texts), "kto"
            (rl: kto: system, prompt, completion and label; prompt_style llama3 or chatml) or
            "chat_template" (a list of messages rendered with the tokenizer's template).
        field: completion: the text field (default "text").
        field_messages: chat_template: the field holding the messages (default "messages").
        message_property_mappings: chat_template: where a message keeps its role and
            content, e.g. ``{role: from, content: value}``.
        roles: chat_template: template role -> names in the data, e.g. ``{user: [human]}``.
        roles_to_train: chat_template: roles whose turns are trained (default assistant).
        drop_system_message: chat_template: leave system messages out.
        field_thinking: chat_template: the message field holding a reasoning trace (default
            "reasoning_content"), handed to the template as ``template_thinking_key``
            (default "reasoning_content").
        split: a slice of the file's records in the hub's split syntax: ``train[:1%]``,
            ``train[10:200]``, ``train[-5%:]`` (None or "train": every record).
        shards, shards_idx: the file's records cut into ``shards`` contiguous pieces, of
            which piece ``shards_idx`` (default 0) is read.
        prompt_style: alpaca and jeopardy: the prompt's style, as Axolotl's ``alpaca:STYLE``:
            "instruct" (default, Alpaca's ``### Instruction:``), "chat" (``USER:`` /
            ``ASSISTANT:``), "chatml" or "phi".
        field_chosen, field_rejected: preference data (``rl: dpo``): the fields holding the
            preferred and the rejected answer to the conversation (defaults "chosen" and
            "rejected"), each a message or its text.
    """

    path: str
    type: str = "completion"
    field: str | None = None
    field_messages: str = "messages"
    message_property_mappings: dict = dataclasses.field(default_factory=dict)
    roles: dict | None = None
    roles_to_train: list = dataclasses.field(default_factory=lambda: ["assistant"])
    drop_system_message: bool = False
    field_thinking: str | None = None
    template_thinking_key: str | None = None
    split: str | None = None
    shards: int | None = None
    shards_idx: int | None = None
    field_chosen: str | None = None
    field_rejected: str | None = None
    prompt_style: str | None = None


_SLICE = re.compile(r"^train(?:\[(-?\d+%?)?(?::(-?\d+%?)?)?\])?$")


def split_bounds(split: str, count: int) -> tuple[int, int]:
    """The records ``split`` selects of ``count``, as ``(start, stop)``; percentages round to
    the closest record, as the hub's datasets library does.

    Raises:
        ValueError: not ``train`` or ``train[a:b]`` (numbers or percentages).
    """
    m = _SLICE.match(split.replace(" ", ""))
    if not m:
        raise ValueError(f"split={split!r} is not train or a slice like train[:10%] or train[100:200]")
    if "[" in split and ":" not in split:  # train[5]: one record
        index = _bound(m.group(1), count, 0)
        return index, index + 1

    def bound(text, default):
        return _bound(text, count, default)

    start, stop = bound(m.group(1), 0), bound(m.group(2), count)
    return max(0, min(start, count)), max(0, min(stop, count))


def _bound(text: str | None, count: int, default: int) -> int:
    if text is None:
        return default
    value = int(round(float(text[:-1]) * count / 100)) if text.endswith("%") else int(text)
    return value + count if value < 0 else value


def select_records(records: list, spec: DatasetSpec) -> list:
    """The records ``spec.split`` and ``spec.shards`` select (all by default)."""
    if spec.split not in (None, "train"):
        start, stop = split_bounds(str(spec.split), len(records))
        records = records[start:stop]
    if spec.shards:
        index = spec.shards_idx or 0
        size, extra = divmod(len(records), spec.shards)
        start = index * size + min(index, extra)
        records = records[start : start + size + (1 if index < extra else 0)]
    return records


def load_records(path: str) -> list:
    """The records of a ``.jsonl`` file (one per line) or a ``.json`` array (or JSON Lines).

    Raises:
        ValueError: not UTF-8 or malformed JSON, naming the file and where.
    """
    text = read_text(path)
    if path.lower().endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, list):
            return data
        if isinstance(data, dict):
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) == 1:
                return lists[0]
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
    return records


def _text(record, key: str, where: str, required: bool = True) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    value = record.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        shown = "missing" if key not in record else f"{type(value).__name__} {json.dumps(value)[:60]}"
        raise ValueError(f"{where}: {key!r} is {shown}, not a string; give each record's {key!r} as text")
    return value


def _alpaca(
    record, tokenizer, train_on_inputs: bool, where: str, style: str | None = None, jeopardy: bool = False
) -> tuple[list[int], list[int]]:
    if jeopardy:  # a clue, its category as the input, and "what is" its answer
        instruction = _text(record, "question", where)
        context = _text(record, "category", where, required=False)
        output = "what is " + _text(record, "answer", where)
    else:
        instruction = _text(record, "instruction", where)
        context = _text(record, "input", where, required=False)
        output = _text(record, "output", where)
    system, with_input, without_input = PROMPT_STYLES[style or "instruct"]
    if context.strip():
        prompt = system.format(system=_SYSTEM_WITH_INPUT) + with_input.format(instruction=instruction, input=context)
    else:
        prompt = system.format(system=_SYSTEM) + without_input.format(instruction=instruction)
    prompt_ids = tokenizer(prompt)["input_ids"]
    answer_ids = tokenizer(output, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        answer_ids = answer_ids + [tokenizer.eos_token_id]
    labels = (list(prompt_ids) if train_on_inputs else [IGNORE] * len(prompt_ids)) + list(answer_ids)
    return list(prompt_ids) + list(answer_ids), labels


def _messages(record, spec: DatasetSpec, where: str) -> list[dict]:
    if not isinstance(record, dict) or not isinstance(record.get(spec.field_messages), list):
        raise ValueError(
            f"{where}: no list of messages under {spec.field_messages!r}; set field_messages to the "
            "field that holds them"
        )
    role_key = spec.message_property_mappings.get("role", "role")
    content_key = spec.message_property_mappings.get("content", "content")
    names = dict(_ROLES)
    for role, aliases in (spec.roles or {}).items():
        for alias in [aliases] if isinstance(aliases, str) else aliases:
            names[alias] = role
    out = []
    for i, message in enumerate(record[spec.field_messages]):
        at = f"{where} message {i}"
        role = _text(message, role_key, at)
        content = _text(message, content_key, at)
        role = names.get(role, role)
        if role == "system" and spec.drop_system_message:
            continue
        turn = {"role": role, "content": content}
        thinking = message.get(spec.field_thinking or "reasoning_content") if isinstance(message, dict) else None
        if isinstance(thinking, str) and thinking:
            turn[spec.template_thinking_key or "reasoning_content"] = thinking
        out.append(turn)
    if not out:
        raise ValueError(f"{where}: the conversation has no messages")
    return out


def _chat(record, spec: DatasetSpec, tokenizer, train_on_inputs: bool, where: str) -> tuple[list[int], list[int]]:
    messages = _messages(record, spec, where)

    def render(upto: int, prompt: bool = False) -> str:
        if upto == 0 and not prompt:
            return ""
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt)

    full = render(len(messages))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    if train_on_inputs:
        return list(ids), list(ids)
    trained = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] not in spec.roles_to_train:
            continue
        # A turn's trained span runs from after its role header (the generation prompt) to
        # the end of its rendering, end-of-turn tokens included.
        start_text = render(i, prompt=message["role"] == "assistant") if i or message["role"] == "assistant" else ""
        end_text = render(i + 1)
        if not (full.startswith(end_text) and end_text.startswith(start_text)):
            raise ValueError(
                f"{where}: the chat template does not render the conversation turn by turn (turn {i} "
                "changes earlier text), so the trained tokens cannot be told apart"
            )
        start, end = len(start_text), len(end_text)
        for k, (a, b) in enumerate(offsets):
            if b > start and a < end:
                trained[k] = True
    labels = [t if keep else IGNORE for t, keep in zip(ids, trained)]
    return list(ids), labels


def build_examples(
    spec: DatasetSpec, tokenizer, seq_len: int, train_on_inputs: bool = False, per_document: bool = False
) -> tuple[list, int]:
    """Tokenized ``(input_ids, labels)`` examples of one dataset, and how many were dropped
    for being longer than ``seq_len``. Completion text is joined and cut into blocks, or with
    ``per_document`` cut per document (each ending with EOS), so that packing keeps
    documents apart.

    Raises:
        ValueError: a malformed record (file, record and fix in the message), or no example.
    """
    if spec.type == "completion":
        texts = select_records(load_texts(spec.path, spec.field or "text"), spec)
        if per_document:
            return document_examples(tokenizer, texts, seq_len), 0
        blocks = TokenBlocks(tokenizer, texts, seq_len)
        return [(row.tolist(), row.tolist()) for row in blocks.data], 0
    if spec.type == "chat_template" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{spec.path}: type chat_template needs a tokenizer with a chat template; this one has none "
            "(set chat_template: chatml, or give a tokenizer that has one)"
        )
    examples, dropped = [], 0
    for index, record in enumerate(select_records(load_records(spec.path), spec)):
        where = f"{spec.path}[{index}]"
        if spec.type in ("alpaca", "jeopardy"):
            ids, labels = _alpaca(record, tokenizer, train_on_inputs, where, spec.prompt_style, spec.type == "jeopardy")
        else:
            ids, labels = _chat(record, spec, tokenizer, train_on_inputs, where)
        if len(ids) > seq_len:
            dropped += 1
            continue
        if any(label != IGNORE for label in labels[1:]):  # something to learn after the shift
            examples.append((ids, labels))
    if not examples:
        raise ValueError(
            f"{spec.path}: no example fits in seq_len={seq_len} with a trained token ({dropped} longer ones dropped)"
        )
    return examples, dropped


def document_examples(tokenizer, texts: list[str], seq_len: int) -> list:
    """Each document tokenized with EOS at its end and cut into pieces of at most
    ``seq_len`` tokens (a last piece of one token, with nothing to predict, is dropped)."""
    examples = []
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        for start in range(0, len(ids), seq_len):
            piece = ids[start : start + seq_len]
            if len(piece) > 1:
                examples.append((piece, list(piece)))
    return examples


def check_path(spec: DatasetSpec) -> str | None:
    """Why ``spec.path`` cannot be read (None when it can)."""
    if not os.path.isfile(spec.path):
        return "does not exist; give a local file (offloadkit train does not download)"
    ext = os.path.splitext(spec.path)[1].lower()
    allowed = FORMATS if spec.type == "completion" else (".jsonl", ".json")
    if ext not in allowed:
        return f"is a {ext or 'extension-less'} file; type {spec.type} reads {', '.join(allowed)}"
    return None


class SFTExamples(torch.utils.data.Dataset):
    """Examples of one or more datasets, each ``{"input_ids", "labels"}`` of its own length."""

    def __init__(self, examples: list) -> None:
        self.examples = examples
        self.tokens = sum(len(ids) for ids, _ in examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        ids, labels = self.examples[index]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long)}


def pad_collate(pad_token_id: int, length: int | None = None):
    """A collator padding each batch to its longest example, or to ``length`` (labels with
    -100, and an attention mask that is 0 on padding)."""
    fixed = length

    def collate(items: list[dict]) -> dict:
        length = max([item["input_ids"].numel() for item in items] + [fixed or 0])
        ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)
        labels = torch.full((len(items), length), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(items), length), dtype=torch.long)
        for row, item in enumerate(items):
            n = item["input_ids"].numel()
            ids[row, :n] = item["input_ids"]
            labels[row, :n] = item["labels"]
            mask[row, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collate
