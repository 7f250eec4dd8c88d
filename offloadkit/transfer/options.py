"""The transfer layer's options, read from the config keys of the same names."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.options import Options, option

__all__ = ["TransferOptions"]


@dataclass
class TransferOptions(Options):
    """How much the run's one prefetch scheduler may hold fetched ahead.

    Attributes:
        window_bytes: ``prefetch_window_bytes``: the most bytes fetched ahead of need and not
            yet used, over activations, streamed weights and optimizer state together; None:
            each bounded by its own look-ahead only.
    """

    window_bytes: int | None = option(None, "prefetch_window_bytes")

    def __post_init__(self) -> None:
        if self.window_bytes is not None:
            if not isinstance(self.window_bytes, int) or isinstance(self.window_bytes, bool):
                raise ValueError(
                    f"{self.named('window_bytes')}={self.window_bytes!r} has the wrong type; "
                    "expected a byte count or a size like '4GiB'"
                )
            if self.window_bytes <= 0:
                raise ValueError(
                    f"{self.named('window_bytes')}={self.window_bytes!r} must be positive; omit it for no shared window"
                )
