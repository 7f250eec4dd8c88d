"""Find a model's output head through the wrappers users put around it."""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap_model", "find_output_head"]

# Attributes through which wrappers expose the model they wrap.
_WRAPPED_ATTRS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_HEAD_ATTRS = ("lm_head", "output", "head")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The innermost model under DDP / FSDP1 / DeepSpeed (``.module``), torch.compile
    (``._orig_mod``), checkpoint wrappers and PEFT (``get_base_model()``).

    Example:
        >>> unwrap_model(torch.nn.parallel.DistributedDataParallel(net)) is net  # doctest: +SKIP
    """
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        get_base = getattr(model, "get_base_model", None)
        if callable(get_base):
            inner = get_base()
            if isinstance(inner, nn.Module) and inner is not model:
                model = inner
                continue
        for attr in _WRAPPED_ATTRS:
            inner = getattr(model, attr, None)
            if isinstance(inner, nn.Module):
                model = inner
                break
        else:
            inner = getattr(model, "module", None)
            # ``.module`` is the DDP/DeepSpeed convention; only follow it when it is the
            # wrapper's sole child so an ordinary submodule named "module" is not mistaken.
            if isinstance(inner, nn.Module) and len(list(model.children())) == 1:
                model = inner
    return model


def find_output_head(model: nn.Module) -> nn.Module | None:
    """The module producing the model's outputs (logits), or None.

    Looks at Hugging Face's ``get_output_embeddings()`` first, then ``lm_head``,
    ``output`` and ``head`` on the model and on its ``model``/``decoder`` submodule.
    """
    base = unwrap_model(model)
    get_out = getattr(base, "get_output_embeddings", None)
    if callable(get_out):
        try:
            head = get_out()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            return head
    for owner in (base, getattr(base, "model", None), getattr(base, "decoder", None)):
        if not isinstance(owner, nn.Module):
            continue
        for attr in _HEAD_ATTRS:
            head = getattr(owner, attr, None)
            if isinstance(head, nn.Module):
                return head
    return None
