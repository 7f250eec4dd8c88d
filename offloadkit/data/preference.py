"""Preference data for DPO (``rl: dpo``): a conversation, the answer preferred and the answer
rejected, from local records of Axolotl's ``chat_template`` preference layout::

    {"conversation": [{"role": "user", "content": "..."}],
     "chosen": {"role": "assistant", "content": "..."},
     "rejected": {"role": "assistant", "content": "..."}}

(the fields named by ``field_messages``, ``field_chosen`` and ``field_rejected``; an answer
may also be its text alone). Each pair becomes TRL's conversational preference example
(``prompt``: the messages, ``chosen``/``rejected``: the one answer), which the DPO trainer
renders with the tokenizer's chat template: the prompt with the assistant's header, each
answer as the assistant's turn after it. Pairs whose longer side does not fit ``seq_len``
are dropped, as long SFT examples are.
"""

from __future__ import annotations

from offloadkit.data.sft import DatasetSpec, _messages, load_records, select_records

__all__ = ["preference_examples", "reward_examples", "kto_examples", "PREFERENCE_FIELDS"]

PREFERENCE_FIELDS = ("chosen", "rejected")


def _answer(record: dict, field: str, spec: DatasetSpec, where: str) -> dict:
    value = record.get(field) if isinstance(record, dict) else None
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, dict):
        (message,) = _messages({"m": [value]}, DatasetSpec(path=spec.path, field_messages="m", **_reading(spec)), where)
        return message
    raise ValueError(
        f"{where}: no answer under {field!r} (a message or its text); set field_chosen and field_rejected to the "
        "fields that hold the two answers"
    )


def _reading(spec: DatasetSpec) -> dict:
    """How ``spec`` reads a message: its property mappings and role names."""
    return {"message_property_mappings": spec.message_property_mappings, "roles": spec.roles}


def preference_examples(spec: DatasetSpec, tokenizer, seq_len: int) -> tuple[list[dict], int]:
    """The preference pairs of one dataset, and how many were dropped for not fitting ``seq_len``.

    Raises:
        ValueError: a malformed record (file, record and fix in the message), a tokenizer
            without a chat template, or no pair that fits.
    """
    if spec.type != "chat_template":
        raise ValueError(f"{spec.path}: preference data is read from type chat_template (got {spec.type!r})")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{spec.path}: preference data needs a tokenizer with a chat template; this one has none "
            "(set chat_template: chatml, or give a tokenizer that has one)"
        )
    chosen_field = spec.field_chosen or "chosen"
    rejected_field = spec.field_rejected or "rejected"

    def length(messages: list[dict]) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    examples, dropped = [], 0
    for index, record in enumerate(select_records(load_records(spec.path), spec)):
        where = f"{spec.path}[{index}]"
        prompt = _messages(record, spec, where)
        chosen = _answer(record, chosen_field, spec, f"{where}.{chosen_field}")
        rejected = _answer(record, rejected_field, spec, f"{where}.{rejected_field}")
        if max(length(prompt + [chosen]), length(prompt + [rejected])) > seq_len:
            dropped += 1
            continue
        examples.append({"prompt": prompt, "chosen": [chosen], "rejected": [rejected]})
    if not examples:
        raise ValueError(f"{spec.path}: no preference pair fits in seq_len={seq_len} ({dropped} longer ones dropped)")
    return examples, dropped


def reward_examples(spec: DatasetSpec, tokenizer, seq_len: int) -> tuple[list[dict], int]:
    """A reward model's pairs (Axolotl's ``bradley_terry.chat_template``): records of
    ``system`` (optional), ``input``, ``chosen`` and ``rejected`` text, each side the
    conversation system, user, assistant rendered with the chat template and tokenized, cut
    at ``seq_len`` tokens as Axolotl cuts them. Returns the pairs (``chosen_ids``,
    ``rejected_ids``) and how many were cut.

    Raises:
        ValueError: a malformed record, a tokenizer without a chat template, or no record.
    """
    from offloadkit.data.sft import _text

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{spec.path}: reward pairs are rendered with the tokenizer's chat template; this one has none "
            "(set chat_template: chatml, or give a tokenizer that has one)"
        )
    pairs, cut = [], 0
    for index, record in enumerate(select_records(load_records(spec.path), spec)):
        where = f"{spec.path}[{index}]"
        system = _text(record, "system", where, required=False)
        head = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": _text(record, "input", where)}
        ]
        sides = {}
        for side in PREFERENCE_FIELDS:
            messages = head + [{"role": "assistant", "content": _text(record, side, where)}]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            sides[f"{side}_ids"] = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if max(len(ids) for ids in sides.values()) > seq_len:
            cut += 1
            sides = {key: ids[:seq_len] for key, ids in sides.items()}
        pairs.append(sides)
    if not pairs:
        raise ValueError(f"{spec.path}: no record")
    return pairs, cut


def kto_examples(spec: DatasetSpec, tokenizer, seq_len: int) -> tuple[list[dict], int]:
    """KTO's labelled completions (Axolotl's ``llama3.ultra``, ``chatml.ultra``): records of
    ``system`` (optional), ``prompt``, ``completion`` and ``label`` (desirable or not), the
    prompt in the style's chat format up to the assistant's header, the completion ended as a
    turn. Returns them (``prompt``, ``completion``, ``label``) and how many were dropped for
    being longer than ``seq_len`` tokens.

    Raises:
        ValueError: a malformed record, or none that fits.
    """
    from offloadkit.data.sft import KTO_STYLES, _text

    system_turn, user_turn, end = KTO_STYLES[spec.prompt_style or "llama3"]
    examples, dropped = [], 0
    for index, record in enumerate(select_records(load_records(spec.path), spec)):
        where = f"{spec.path}[{index}]"
        label = record.get("label") if isinstance(record, dict) else None
        if not isinstance(label, bool):
            raise ValueError(f"{where}: 'label' must be true (a desirable completion) or false, got {label!r}")
        system = _text(record, "system", where, required=False)
        prompt = (system_turn.format(system=system) if system else "") + user_turn.format(
            prompt=_text(record, "prompt", where)
        )
        completion = _text(record, "completion", where) + end
        if len(tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]) > seq_len:
            dropped += 1
            continue
        examples.append({"prompt": prompt, "completion": completion, "label": label})
    if not examples:
        raise ValueError(f"{spec.path}: no example fits in seq_len={seq_len} ({dropped} longer ones dropped)")
    return examples, dropped
