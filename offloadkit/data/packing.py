"""Examples packed into rows of ``seq_len`` tokens, each example attending only to itself.

A row holds several examples one after another. Its position ids restart at 0 at the start
of each example, which is how the attention tells them apart: Hugging Face models build a
block-diagonal causal mask from such position ids (sdpa, eager) or run flash-attention's
variable-length kernel over them, when no attention mask and no cache are given. The first
label of each example is -100, so the last token of one example never predicts the first of
the next: every example's loss is its loss alone. A row is padded at its end as one more
example of padding (labels -100), which no real token attends to.

Whether a model's attention honours such position ids is measured, not assumed:
:func:`packing_keeps_documents_apart` runs one packed probe through the model. A model
whose decoder builds its masks without reading the position ids gets them built from the
position ids before its forward (:func:`mask_packed_documents`), and is measured again.
"""

from __future__ import annotations

import torch

from offloadkit.data.sft import IGNORE

__all__ = ["pack_examples", "PackedRows", "packed_collate", "packing_keeps_documents_apart", "mask_packed_documents"]


def pack_examples(examples: list, seq_len: int, sequential: bool = False) -> list:
    """``(input_ids, labels)`` examples packed into rows of at most ``seq_len`` tokens:
    first-fit, longest first, or with ``sequential`` in their order (the next example
    starts a new row when it does not fit in the current one).

    Returns:
        Rows as ``(input_ids, labels, position_ids)`` lists.
    """
    rows: list[list[int]] = []  # indices of the examples of each row
    room: list[int] = []
    if sequential:
        for i, (example_ids, _) in enumerate(examples):
            if rows and len(example_ids) <= room[-1]:
                rows[-1].append(i)
                room[-1] -= len(example_ids)
            else:
                rows.append([i])
                room.append(seq_len - len(example_ids))
    order = [] if sequential else sorted(range(len(examples)), key=lambda i: (-len(examples[i][0]), i))
    for i in order:
        n = len(examples[i][0])
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(seq_len - n)
    packed = []
    for members in rows:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for i in members:
            example_ids, example_labels = examples[i]
            ids += list(example_ids)
            labels += [IGNORE] + list(example_labels[1:])  # nothing predicts an example's first token
            positions += list(range(len(example_ids)))
        packed.append((ids, labels, positions))
    return packed


class PackedRows(torch.utils.data.Dataset):
    """Packed rows, each ``{"input_ids", "labels", "position_ids"}``."""

    def __init__(self, rows: list, examples: int) -> None:
        self.rows = rows
        self.examples = examples  # how many examples the rows hold
        self.tokens = sum(len(ids) for ids, _, _ in rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        ids, labels, positions = self.rows[index]
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "position_ids": torch.tensor(positions, dtype=torch.long),
        }


def packed_collate(pad_token_id: int, length: int | None = None):
    """A collator for :class:`PackedRows`: rows padded to the longest (or to ``length``) with
    a padding example (its own positions, labels -100), and no attention mask, so that the
    model reads the documents from the position ids."""
    fixed = length

    def collate(items: list[dict]) -> dict:
        length = max([item["input_ids"].numel() for item in items] + [fixed or 0])
        ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)
        labels = torch.full((len(items), length), IGNORE, dtype=torch.long)
        positions = torch.zeros((len(items), length), dtype=torch.long)
        for row, item in enumerate(items):
            n = item["input_ids"].numel()
            ids[row, :n] = item["input_ids"]
            labels[row, :n] = item["labels"]
            positions[row, :n] = item["position_ids"]
            positions[row, n:] = torch.arange(length - n)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

    return collate


def packing_keeps_documents_apart(model, vocab_size: int | None = None, length: int = 6) -> tuple[bool, str]:
    """Whether ``model`` keeps packed documents apart: the logits of a second document must
    not change when the first one does (the same shapes, positions and kernels both times).

    Returns:
        ``(True, "")``, or ``(False, why)``.
    """
    vocab = vocab_size or int(model.get_input_embeddings().weight.shape[0])
    device = model.get_input_embeddings().weight.device
    g = torch.Generator().manual_seed(0)
    second = torch.randint(3, max(4, min(vocab, 1000) - 3), (length,), generator=g)
    firsts = [torch.randint(3, max(4, min(vocab, 1000) - 3), (length,), generator=g) for _ in range(2)]
    positions = torch.cat([torch.arange(length), torch.arange(length)]).unsqueeze(0).to(device)
    was_training = model.training
    model.eval()
    outputs = []
    try:
        with torch.no_grad():
            for first in firsts:
                ids = torch.cat([first, second]).unsqueeze(0).to(device)
                logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
                outputs.append(logits[0, length:].float().cpu())
    except (TypeError, ValueError, RuntimeError) as exc:
        return False, f"it cannot take position ids ({type(exc).__name__}: {' '.join(str(exc).split())[:100]})"
    finally:
        model.train(was_training)
    change = (outputs[0] - outputs[1]).abs().max().item()
    scale = outputs[0].abs().max().item() or 1.0
    if change > 1e-3 * scale:
        return False, "a document's logits change with the document packed before it"
    return True, ""


def mask_packed_documents(model) -> bool:
    """For a model whose decoder builds its attention masks without the position ids (GPT-OSS,
    AFMoE, ...): build them from the position ids before its forward, with transformers' own
    mask functions for each of its layer types (full, sliding window, chunked), as models that
    read packed position ids do. Kept only when :func:`packing_keeps_documents_apart` then
    holds; otherwise removed.

    Returns:
        Whether the model now keeps packed documents apart.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - a model here is a transformers model
        return False
    makers = {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        "chunked_attention": masking_utils.create_chunked_causal_mask,
    }
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    config = getattr(decoder, "config", None)
    if decoder is None or config is None:
        return False
    kinds = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
    if not set(kinds) <= set(makers):
        return False
    embeddings = model.get_input_embeddings()

    def packed_masks(module, args, kwargs):
        positions = kwargs.get("position_ids")
        if positions is None or kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None:
            return None
        tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            return None
        batch, length = tokens.shape[:2]
        positions = positions.expand(batch, -1) if positions.shape[0] != batch else positions
        if masking_utils.find_packed_sequence_indices(positions) is None:
            return None  # one document per row: the model's own masks are right
        # The mask functions read only the shape, dtype and device of the embeddings.
        shape = torch.empty(batch, length, 0, dtype=embeddings.weight.dtype, device=positions.device)
        kwargs["attention_mask"] = {
            kind: makers[kind](
                config=config, inputs_embeds=shape, attention_mask=None, cache=None, position_ids=positions
            )
            for kind in kinds
        }
        return args, kwargs

    handle = decoder.register_forward_pre_hook(packed_masks, with_kwargs=True)
    try:
        apart = packing_keeps_documents_apart(model)[0]
    except Exception:  # a decoder that takes no such masks (Mamba-style): it stays as it was
        apart = False
    if apart:
        model._offloadkit_packed_masks = handle  # removable, and a sign for the report
        return True
    handle.remove()
    return False
