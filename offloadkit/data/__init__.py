"""Data for the ``offloadkit train`` command: a small public-domain corpus (the opening of
Shakespeare's Coriolanus, 64 KB), a local byte-level tokenizer, and text loading."""

from offloadkit.data.text import DEFAULT_CORPUS, TokenBlocks, load_texts
from offloadkit.data.tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer

__all__ = ["BYTE_VOCAB_SIZE", "DEFAULT_CORPUS", "TokenBlocks", "byte_tokenizer", "load_texts"]
