"""Optional packages and the extra that installs each, for one-line import errors.

A base install (``pip install offloadkit``) has torch and psutil only. Where a command or an
integration imports an optional package, it goes through :func:`require` (one module) or
:func:`needs` (around ``from ... import ...`` statements), so a missing package reads
``offloadkit train needs transformers: pip install 'offloadkit[hf]'`` rather than
``No module named 'transformers'``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "available", "check", "message", "needs", "require"]

# Top-level module -> the extra of pyproject.toml that installs it.
EXTRAS: dict[str, str] = {
    "transformers": "hf",
    "peft": "hf",
    "accelerate": "hf",
    "trl": "hf",
    "yaml": "yaml",
    "matplotlib": "plot",
    "tensorboard": "tensorboard",
    "bitsandbytes": "qlora",
    "torchao": "lowbit-optim",
    "liger_kernel": "liger",
}


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the extra that installs it."""


def message(modules: list[str] | str, why: str, extra: str | None = None) -> str:
    """``'{why} needs {modules}: pip install 'offloadkit[{extra}]''`` as one line."""
    names = [modules] if isinstance(modules, str) else list(modules)
    extras = [extra] if extra else sorted({EXTRAS.get(n.split(".")[0], "all") for n in names})
    return f"{why} needs {' and '.join(names)}: pip install 'offloadkit[{','.join(extras)}]'"


def available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check(modules: list[str] | tuple[str, ...], why: str) -> None:
    """Raise :class:`MissingExtraError` naming every one of ``modules`` that is not installed
    (checked without importing them)."""
    missing = [m for m in modules if not available(m)]
    if missing:
        raise MissingExtraError(message(missing, why))


@contextlib.contextmanager
def needs(why: str, extra: str | None = None) -> Iterator[None]:
    """Around optional imports: a missing optional package (one in :data:`EXTRAS`, or any
    module when ``extra`` is given) becomes :class:`MissingExtraError` naming the extra.

    A name missing from a package that is installed (an older version) and a missing
    dependency of an installed package pass through unchanged.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        name = (exc.name or "").split(".")[0]
        if extra is None and name not in EXTRAS:
            raise
        raise MissingExtraError(message(name or "an optional package", why, extra)) from exc


def require(module: str, extra: str | None, why: str) -> ModuleType:
    """Import and return ``module``; if it is not installed, raise :class:`MissingExtraError`
    saying ``{why} needs {module}: pip install 'offloadkit[{extra}]'``."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != top:
            raise  # a dependency of an installed package is missing: its own message says which
        raise MissingExtraError(message(module, why, extra or EXTRAS.get(top))) from exc
