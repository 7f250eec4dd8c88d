"""A module's ``forward`` replaced on the instance (no class is patched), and put back.

Used by the long-context parts that wrap modules inside the decoder layers (the tiled MLP and
projections, attention over head groups): a mark in the instance's ``__dict__`` says the
module is already wrapped, and ``remove()`` restores whatever the instance held before
(its own ``forward`` attribute, or none), unless something else replaced ours since.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["ForwardWraps"]


class ForwardWraps:
    """The forwards one handle replaced.

    Args:
        mark: the ``__dict__`` key naming this kind of wrap.
    """

    def __init__(self, mark: str) -> None:
        self.mark = mark
        self._saved: list[tuple[nn.Module, object]] = []

    def holds(self, module: nn.Module) -> bool:
        """Whether ``module``'s forward is already wrapped this way (by any handle)."""
        return self.mark in module.__dict__

    def wrap(self, module: nn.Module, wrapper: Callable) -> None:
        """Make ``wrapper`` the instance's forward."""
        previous = module.__dict__.get("forward")
        module.forward = wrapper  # type: ignore[method-assign]
        module.__dict__[self.mark] = wrapper
        self._saved.append((module, previous))

    def wrap_all(self, modules: list[tuple[str, nn.Module]], make_wrapper: Callable, already: str) -> None:
        """Wrap every module, or none: each is checked before any is touched.

        Args:
            modules: (name, module) pairs.
            make_wrapper: ``(name, module) -> wrapper`` (called before the module is wrapped).
            already: what a module already wrapped this way does, for the error.

        Raises:
            ValueError: naming the first module already wrapped this way.
        """
        for name, module in modules:
            if self.holds(module):
                raise ValueError(f"{name} {already}; remove() the first handle")
        for name, module in modules:
            self.wrap(module, make_wrapper(name, module))

    def remove(self) -> None:
        """Restore every wrapped module's forward."""
        for module, previous in self._saved:
            ours = module.__dict__.pop(self.mark, None)
            if ours is not None and module.__dict__.get("forward") is ours:
                if previous is None:
                    del module.forward
                else:
                    module.forward = previous  # type: ignore[method-assign, assignment]
        self._saved.clear()
