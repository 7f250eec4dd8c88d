"""Plain text and JSONL datasets cut into fixed-length token blocks for causal LM training."""

from __future__ import annotations

import json
import os
from importlib import resources

import torch

__all__ = ["DEFAULT_CORPUS", "FORMATS", "load_texts", "TokenBlocks"]

DEFAULT_CORPUS = "shakespeare.txt"


FORMATS = (".txt", ".jsonl", ".json")


def _record_text(record, text_field: str, where: str) -> str:
    if isinstance(record, str):
        return record
    if not isinstance(record, dict) or text_field not in record:
        raise ValueError(f"{where}: no {text_field!r} field; set text_field to the key that holds the text")
    text = record[text_field]
    if not isinstance(text, str):
        # str() of null, a number or a list would train on "None", "5" or "['a', 'b']".
        raise ValueError(
            f"{where}: {text_field!r} is {type(text).__name__} {json.dumps(text)[:60]}, not a string; "
            f"give each record's {text_field!r} as text, or drop the record"
        )
    return text


def _json_lines(path: str, text_field: str) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
            texts.append(_record_text(record, text_field, f"{path}:{number}"))
    return texts


def _json_document(path: str, text_field: str) -> list[str]:
    """A ``.json`` file: an array of records (or strings), else JSON Lines under that name."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _json_lines(path, text_field)  # many ".json" datasets are JSON Lines
    if isinstance(data, dict) and text_field in data:
        data = [data]
    elif isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(
                f"{path}: a JSON object must hold one list of records; give an array of records "
                f"with a {text_field!r} field, or JSON Lines"
            )
        data = lists[0]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected an array of records with a {text_field!r} field")
    return [_record_text(r, text_field, f"{path}[{i}]") for i, r in enumerate(data)]


def load_texts(path: str | None = None, text_field: str = "text") -> list[str]:
    """Documents from a ``.txt`` file (one document), a ``.jsonl`` file (one record per line
    with a ``text_field``), a ``.json`` file (an array of such records, or JSON Lines), or
    the shipped public-domain corpus when ``path`` is None.

    Raises:
        FileNotFoundError: no such file.
        ValueError: another format, malformed JSON, a missing field, or no text.
    """
    if path is None:
        return [resources.files("offloadkit.data").joinpath(DEFAULT_CORPUS).read_text(encoding="utf-8")]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist (give a .txt, .jsonl or .json file)")
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError(
            f"dataset {path!r}: {ext or 'no extension'} is not a format offloadkit reads; convert it "
            'to .jsonl (one {"text": ...} per line), .json or .txt'
        )
    if ext == ".txt":
        with open(path, encoding="utf-8") as f:
            texts = [f.read()]
    elif ext == ".jsonl":
        texts = _json_lines(path, text_field)
    else:
        texts = _json_document(path, text_field)
    if not any(t.strip() for t in texts):
        raise ValueError(f"{path}: no text")
    return texts


class TokenBlocks(torch.utils.data.Dataset):
    """Documents tokenized, joined with EOS, and cut into blocks of ``seq_len`` tokens.

    Items are ``{"input_ids": LongTensor[seq_len], "labels": same}`` (the model shifts).
    """

    def __init__(self, tokenizer, texts: list[str], seq_len: int) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r} is too short; use at least 2 tokens")
        ids: list[int] = []
        for text in texts:
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
        blocks = len(ids) // seq_len
        if blocks == 0:
            raise ValueError(f"the dataset has {len(ids)} tokens, fewer than one block of seq_len={seq_len}")
        self.data = torch.tensor(ids[: blocks * seq_len], dtype=torch.long).view(blocks, seq_len)
        self.tokens = blocks * seq_len

    def __len__(self) -> int:
        return self.data.size(0)

    def __getitem__(self, index: int) -> dict:
        block = self.data[index]
        return {"input_ids": block, "labels": block.clone()}
