"""A byte-level tokenizer built locally (no vocabulary download): 256 byte tokens plus
``<pad>``, ``<bos>``, ``<eos>``, wrapped as a Hugging Face fast tokenizer so it saves and
loads like any other."""

from __future__ import annotations

__all__ = ["byte_tokenizer", "BYTE_VOCAB_SIZE"]

BYTE_VOCAB_SIZE = 259


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` over raw UTF-8 bytes (ids 0-255) and three specials.

    Example:
        >>> tok = byte_tokenizer()
        >>> tok("hi")["input_ids"]
        [104, 105]
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise ImportError("the byte tokenizer needs Hugging Face transformers: pip install 'offloadkit[hf]'") from exc
    # ByteLevel maps byte b to a printable character; order the vocabulary by byte value.
    byte_to_char = {}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Rebuild GPT-2's byte->unicode table: printable bytes map to themselves, others shift past 255.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    shift = 0
    for b in range(256):
        if b in printable:
            byte_to_char[b] = chr(b)
        else:
            byte_to_char[b] = chr(256 + shift)
            shift += 1
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    from offloadkit.data.sft import CHATML_TEMPLATE

    # ChatML as plain bytes, so chat datasets (type chat_template) work with the built-in model.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        chat_template=CHATML_TEMPLATE,
    )
