"""Reading and writing the checkpointing fields of Hugging Face training arguments across
transformers versions.

transformers 4.x reads ``gradient_checkpointing`` / ``gradient_checkpointing_kwargs``.
Later versions renamed them ``activation_checkpointing`` / ``activation_checkpointing_kwargs``
and keep the old names as aliases that are mirrored only once, when the arguments are
built: setting the old name afterwards is silently ignored by the Trainer. Writers here
therefore set every name the arguments object has, and readers prefer the new name.
"""

from __future__ import annotations

import dataclasses

__all__ = ["checkpointing_requested", "checkpointing_kwargs", "set_checkpointing", "user_set", "model_checkpointing_on"]

_FLAGS = ("activation_checkpointing", "gradient_checkpointing")
_KWARGS = ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")


def _present(args, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if hasattr(args, name)]


def checkpointing_requested(args) -> bool:
    """Whether ``args`` asks the Trainer for checkpointing (under either name)."""
    for name in _present(args, _FLAGS):
        value = getattr(args, name)
        if value is not None:
            return bool(value)
    return False


def checkpointing_kwargs(args) -> dict:
    """The checkpointing keyword arguments of ``args`` (a copy; empty when unset)."""
    for name in _present(args, _KWARGS):
        value = getattr(args, name)
        if value:
            return dict(value)
    return {}


def set_checkpointing(args, enabled: bool, kwargs: dict | None = None):
    """Set checkpointing on ``args`` under every name it has.

    Args:
        args: training arguments (any version), or any object with those attributes.
        enabled: turn checkpointing on or off.
        kwargs: checkpointing keyword arguments; None leaves them as they are.

    Returns:
        A function restoring the previous values.
    """
    names = _present(args, _FLAGS) + (_present(args, _KWARGS) if kwargs is not None else [])
    if not _present(args, _FLAGS):
        raise TypeError(
            f"{type(args).__name__} has neither activation_checkpointing nor gradient_checkpointing; "
            "pass Hugging Face TrainingArguments"
        )
    before = {name: getattr(args, name) for name in names}
    for name in _present(args, _FLAGS):
        setattr(args, name, enabled)
    if kwargs is not None:
        for name in _present(args, _KWARGS):
            setattr(args, name, dict(kwargs))

    def restore() -> None:
        for name, value in before.items():
            setattr(args, name, value)

    return restore


def user_set(args, name: str) -> bool:
    """Whether ``args.name`` exists and differs from its dataclass default.

    A default (TRL's ``activation_offloading=False``, say) is not a choice the user made,
    so it must not override offloadkit's own defaults. On objects that are not dataclasses
    every existing attribute counts as set.
    """
    if not hasattr(args, name):
        return False
    if not dataclasses.is_dataclass(args):
        return True
    field = {f.name: f for f in dataclasses.fields(args)}.get(name)
    if field is None:
        return True
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        return True
    return getattr(args, name) != default


def model_checkpointing_on(model) -> bool:
    """Whether Hugging Face checkpointing is switched on in any module of ``model``."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
