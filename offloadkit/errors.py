"""The errors a configuration raises, below every module that checks one (the components
refuse settings with them; :mod:`offloadkit.config` re-exports them)."""

from __future__ import annotations

__all__ = ["ConfigError", "ConfigProblemsError", "UnsupportedError"]


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names key, value and fix."""


class UnsupportedError(ConfigError):
    """A setting asking for a feature offloadkit does not have; the message names it."""


class ConfigProblemsError(ConfigError):
    """Several problems of one config, reported together.

    Attributes:
        problems: ``(message, unsupported)`` pairs, in the order found.
    """

    def __init__(self, source: str, problems: list[tuple[str, bool]]) -> None:
        self.problems = problems
        if len(problems) == 1:
            text = f"{source}: {problems[0][0]}"
        else:
            text = f"{source}: {len(problems)} problems: " + "; ".join(
                f"({i}) {m}" for i, (m, _) in enumerate(problems, 1)
            )
        super().__init__(text)

    @property
    def unsupported_only(self) -> bool:
        return all(unsupported for _, unsupported in self.problems)
