"""Plain text and JSONL datasets cut into fixed-length token blocks for causal LM training."""

from __future__ import annotations

import json
import os
from importlib import resources

import torch

__all__ = ["DEFAULT_CORPUS", "load_texts", "TokenBlocks"]

DEFAULT_CORPUS = "shakespeare.txt"


def load_texts(path: str | None = None, text_field: str = "text") -> list[str]:
    """Documents from a ``.txt`` file (one document), a ``.jsonl`` file (one object per line
    with a ``text_field``), or the shipped public-domain corpus when ``path`` is None."""
    if path is None:
        return [resources.files("offloadkit.data").joinpath(DEFAULT_CORPUS).read_text(encoding="utf-8")]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist (give a .txt or .jsonl file)")
    if path.endswith(".jsonl"):
        texts = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
                if not isinstance(record, dict) or text_field not in record:
                    raise ValueError(f"{path}:{number}: no {text_field!r} field; set text_field to the right key")
                texts.append(str(record[text_field]))
        if not texts:
            raise ValueError(f"{path}: no documents")
        return texts
    with open(path, encoding="utf-8") as f:
        return [f.read()]


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
