"""Plain text and JSONL datasets cut into fixed-length token blocks for causal LM training."""

from __future__ import annotations

import codecs
import json
import os
from importlib import resources

import torch

__all__ = ["DEFAULT_CORPUS", "FORMATS", "load_texts", "not_utf8", "read_text", "TokenBlocks"]

DEFAULT_CORPUS = "shakespeare.txt"


FORMATS = (".txt", ".jsonl", ".json")


def not_utf8(path: str) -> ValueError:
    """The error for a dataset file that is not UTF-8: its first invalid byte and the fix.

    The file is decoded again in chunks to find the byte: the error of a text-mode read counts
    from the start of its read buffer, not of the file."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = newlines = 0  # bytes and newlines before the chunk being decoded
    head = b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            head = head or chunk[:2]
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                # The decoder holds back an unfinished character's bytes: they lead its input.
                held = len(exc.object) - len(chunk)
                at = offset - held + exc.start
                line = newlines + exc.object.count(b"\n", 0, exc.start) + 1
                break
            if not chunk:
                at, line = offset, newlines + 1  # decodes after all: report where it ends
                break
            offset += len(chunk)
            newlines += chunk.count(b"\n")
    source = "utf-16" if head in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE) else "latin1"
    name = os.path.basename(path)
    stem, ext = os.path.splitext(name)
    return ValueError(
        f"{path}: not UTF-8 (byte {at}, line {line}); re-encode it as UTF-8, "
        f"e.g. iconv -f {source} -t utf-8 {name} > {stem}.utf8{ext}"
    )


def read_text(path: str) -> str:
    """The whole of a dataset file as text (UTF-8, universal newlines).

    Raises:
        ValueError: the file is not UTF-8 (naming the file, the byte and the fix).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise not_utf8(path) from None


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
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
                texts.append(_record_text(record, text_field, f"{path}:{number}"))
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    return texts


def _json_document(path: str, text_field: str) -> list[str]:
    """A ``.json`` file: an array of records (or strings), else JSON Lines under that name."""
    text = read_text(path)
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
        ValueError: another format, not UTF-8, malformed JSON, a missing field, or no text.
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
        texts = [read_text(path)]
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
