"""Find the repeated blocks of a model (decoder layers, encoder blocks, ...).

Explicit beats guessed: pass ``block_types`` (classes) or ``predicate(name, module)``.
Auto-detection is a convenience for Hugging Face models and anything with the same shape:
Hugging Face marks its layers as ``GradientCheckpointingLayer``; otherwise the blocks are
the children of module lists whose two or more children share one class and hold
parameters (``model.layers``, ``transformer.h``, ``encoder.block`` + ``decoder.block``).
"""

from __future__ import annotations

from typing import Callable, Iterable

from torch import nn

from offloadkit.models.heads import unwrap_model

__all__ = ["find_blocks", "attention_module", "attention_modules"]

Predicate = Callable[[str, nn.Module], bool]


def _hf_layer_class():
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except Exception:
        return None
    return GradientCheckpointingLayer


def _outermost(named: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop matches nested inside an earlier match (named_modules is pre-order)."""
    picked: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if any(name.startswith(p + ".") for p, _ in picked):
            continue
        picked.append((name, module))
    return picked


def _from_module_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        if not any(True for _ in children[0][1].parameters()):
            continue
        found.extend((f"{name}.{n}" if name else n, c) for n, c in children)
    return _outermost(found)


def find_blocks(
    model: nn.Module,
    block_types: tuple[type, ...] | list[type] | None = None,
    predicate: Predicate | None = None,
) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks as ``(qualified name, module)`` in forward order.

    Args:
        model: the model (DDP/FSDP/PEFT/compile wrappers are looked through).
        block_types: block classes, e.g. ``(LlamaDecoderLayer,)``.
        predicate: ``predicate(name, module) -> bool`` selecting blocks.

    Raises:
        ValueError: when nothing matches; the message says how to name the blocks.

    Example:
        >>> [name for name, _ in find_blocks(build_llama("tiny"))]
        ['model.layers.0', 'model.layers.1']
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if block_types is not None and predicate is not None:
        raise ValueError("pass either block_types or predicate, not both")
    base = unwrap_model(model)
    if predicate is not None:
        blocks = _outermost((n, m) for n, m in base.named_modules() if n and predicate(n, m))
        how = "predicate"
    elif block_types is not None:
        types: tuple[type, ...] = tuple(block_types)
        if not types or not all(isinstance(t, type) for t in types):
            raise ValueError(f"block_types={block_types!r} must be a non-empty tuple of module classes")
        blocks = _outermost((n, m) for n, m in base.named_modules() if isinstance(m, types))  # type: ignore[misc]
        how = f"block_types={[t.__name__ for t in types]}"
    else:
        hf_layer = _hf_layer_class()
        blocks = []
        if hf_layer is not None:
            blocks = _outermost((n, m) for n, m in base.named_modules() if isinstance(m, hf_layer))
        if not blocks:
            blocks = _from_module_lists(base)
        how = "auto-detection"
    if not blocks:
        raise ValueError(
            f"no blocks found in {type(base).__name__} by {how}; name them with "
            "block_types=(MyBlock,) or predicate=lambda name, module: ..."
        )
    return blocks


def attention_module(block: nn.Module) -> tuple[str, nn.Module] | None:
    """A decoder layer's attention module and its attribute name (``self_attn``, ``attn`` or
    ``attention``, as Hugging Face models name it), or None."""
    for attr in ("self_attn", "attn", "attention"):
        module = getattr(block, attr, None)
        if isinstance(module, nn.Module):
            return attr, module
    return None


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every decoder layer's attention module, as ``(qualified name, module)`` pairs (PEFT
    wrappers looked through).

    Raises:
        ValueError: the model's decoder layers have none.
    """
    base = unwrap_model(model)
    modules = []
    for name, block in find_blocks(base):
        found = attention_module(block)
        if found is not None:
            modules.append((f"{name}.{found[0]}", found[1]))
    if not modules:
        raise ValueError(f"no attention modules found in the decoder layers of {type(base).__name__}")
    return modules
