"""What every component's options dataclass shares: each field names the config key it is
read from (``field(metadata={"key": ...})``), and its checks raise ``ValueError`` naming the
setting as the caller wrote it (the config key when a config builds the options, the field
when Python code does: ``DiskOptions(directory=...)``), the value and the fix.

A component owns its options beside it (``engine/options.py``, ``layers/options.py``, ...):
the fields, their defaults and their documentation are stated there once.
:class:`~offloadkit.config.OffloadConfig` maps the YAML keys users know onto them and restates
no default.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

__all__ = ["Options", "option"]

# True while a config builds options (``Options.from_config``): their messages then name the
# config keys the user wrote rather than the fields.
_FROM_CONFIG: contextvars.ContextVar[bool] = contextvars.ContextVar("offloadkit_options_from_config", default=False)


def option(default: Any, key: str) -> Any:
    """A dataclass field with a default, read from config key ``key``."""
    return dataclasses.field(default=default, metadata={"key": key})


class Options:
    """Base of the components' options dataclasses."""

    @classmethod
    def keys(cls) -> dict[str, str]:
        """Config key -> field name, for the fields a config sets (the others keep their default)."""
        return {f.metadata["key"]: f.name for f in dataclasses.fields(cls) if "key" in f.metadata}  # type: ignore[arg-type]

    @classmethod
    def config_keys(cls, **values: Any) -> dict[str, Any]:
        """The config keys that set these fields to ``values`` (field name -> value), for code
        that writes a config from options (a plan): the keys are spelled once, here.

        Raises:
            ValueError: a name that is not a field set by a config key.
        """
        by_field = {name: key for key, name in cls.keys().items()}
        unknown = sorted(set(values) - set(by_field))
        if unknown:
            raise ValueError(f"{cls.__name__} has no field set by a config key named {', '.join(unknown)}")
        return {by_field[name]: value for name, value in values.items()}

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field ``name``."""
        return next(f.default for f in dataclasses.fields(cls) if f.name == name)  # type: ignore[arg-type]

    @classmethod
    def from_config(cls, config: Any):
        """These options as ``config`` (anything with the config keys as attributes) sets them."""
        values = {name: getattr(config, key) for key, name in cls.keys().items()}
        token = _FROM_CONFIG.set(True)
        try:
            return cls(**values)
        finally:
            _FROM_CONFIG.reset(token)

    def key(self, name: str) -> str:
        """The config key of field ``name``."""
        return next(f.metadata.get("key", f.name) for f in dataclasses.fields(self) if f.name == name)  # type: ignore[arg-type]

    def named(self, name: str) -> str:
        """Field ``name`` as the caller wrote it, for messages: its config key while a config
        builds these options, else the field's own name."""
        return self.key(name) if _FROM_CONFIG.get() else name

    def said(self, name: str, value: Any) -> str:
        """``name`` set to ``value`` as the caller would write it: ``key: value`` in a config
        (YAML), ``field=value`` in Python."""
        if _FROM_CONFIG.get():
            text = str(value).lower() if isinstance(value, bool) else value
            return f"{self.key(name)}: {text}"
        return f"{name}={value!r}"

    def _bool(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise ValueError(
                f"{self.named(name)}={value!r} has the wrong type ({type(value).__name__}); expected true or false"
            )

    def _int(self, name: str, low: int, what: str, optional: bool = False) -> None:
        value = getattr(self, name)
        if optional and value is None:
            return
        if not isinstance(value, int) or isinstance(value, bool):
            extra = ", or omit it" if optional else ""
            raise ValueError(
                f"{self.named(name)}={value!r} has the wrong type ({type(value).__name__}); "
                f"expected an integer >= {low}{extra}"
            )
        if value < low:
            raise ValueError(f"{self.named(name)}={value!r} is too small; it must be >= {low} ({what})")

    def _path(self, name: str) -> None:
        value = getattr(self, name)
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"{self.named(name)}={value!r} has the wrong type ({type(value).__name__}); expected a directory path"
            )
