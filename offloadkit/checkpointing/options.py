"""Checkpointing's options, read from the config keys of the same names."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.defaults import BLOCK_INPUT_PLACES
from offloadkit.options import Options, option

__all__ = ["CheckpointOptions"]


@dataclass
class CheckpointOptions(Options):
    """Which decoder layers are checkpointed, what they save, and where their inputs wait.

    Attributes:
        enabled: ``gradient_checkpointing``: checkpoint every decoder layer (non-reentrant).
        selective: ``selective_checkpointing``: op groups saved instead of recomputed ("mm",
            "attention"); None recomputes everything. Every layer holds their outputs on the
            GPU from forward to backward (the planner counts them); "mm" does not combine
            with ``fused_lora``.
        gpu_block_inputs: ``gpu_block_inputs``: with offloading, block inputs kept on the GPU
            besides the last block's (the newest, needed first in backward): for a GPU with
            room to spare where RAM and disk are short (``offload_plan: auto`` sets it).
        recompute_block_inputs: ``recompute_block_inputs``: indices of layers whose inputs are
            kept nowhere (not on the GPU, in RAM or on disk): backward recomputes each from the
            nearest kept input before it, running the layers in between forward again (needs
            offloadkit's checkpointing: ``gradient_checkpointing`` without the Trainer's own).
        block_input_placement: ``block_input_placement``: per layer, where its input waits for
            backward: "gpu", "ram", "disk" or "recompute" (kept nowhere); exactly what a plan
            chose (``offload_plan: auto`` sets it). Replaces ``gpu_block_inputs`` and
            ``recompute_block_inputs``; "disk" needs ``activation_offloading: disk``.
        keep_attention: ``keep_attention_outputs``: with block inputs offloaded, each fused
            attention kernel's output and log-sum-exp (SDPA's cuDNN, flash or efficient kernel)
            wait in the same storage for the recompute, which then skips the kernel
            (``checkpointing/attention.py``): one attention forward less per layer, the
            gradients bitwise the same; pays at long context (``offload_plan: auto`` sets it).
            True for every layer, or how many of the last layers (what RAM holds).
    """

    enabled: bool = option(False, "gradient_checkpointing")
    selective: list[str] | None = option(None, "selective_checkpointing")
    gpu_block_inputs: int = option(0, "gpu_block_inputs")
    recompute_block_inputs: tuple[int, ...] = option((), "recompute_block_inputs")
    block_input_placement: tuple[str, ...] = option((), "block_input_placement")
    keep_attention: bool | int = option(False, "keep_attention_outputs")

    def __post_init__(self) -> None:
        self._bool("enabled")
        if not isinstance(self.keep_attention, bool):
            self._int("keep_attention", 0, "how many of the last layers keep their attention outputs")
        self._int("gpu_block_inputs", 0, "block inputs kept on the GPU")
        if isinstance(self.recompute_block_inputs, list):
            self.recompute_block_inputs = tuple(self.recompute_block_inputs)  # YAML gives a list
        dropped = self.recompute_block_inputs
        if not isinstance(dropped, tuple) or any(type(i) is not int or i < 1 for i in dropped):
            raise ValueError(
                f"{self.named('recompute_block_inputs')}={dropped!r} is invalid; give layer indices >= 1 "
                "(layer 0's input has nothing before it to be recomputed from), e.g. [2, 4, 6]"
            )
        if self.selective is not None:
            if not isinstance(self.selective, (list, tuple)):
                raise ValueError(
                    f"{self.named('selective')}={self.selective!r} has the wrong type "
                    f"({type(self.selective).__name__}); "
                    'expected a list like ["mm", "attention"]'
                )
            from offloadkit.checkpointing.selective import OP_GROUPS

            bad = [op for op in self.selective if op not in OP_GROUPS]
            if bad:
                raise ValueError(f"{self.named('selective')} has unknown op groups {bad}; use {sorted(OP_GROUPS)}")
            if not self.enabled:
                raise ValueError(f"{self.named('selective')} needs {self.said('enabled', True)}")
        self._check_placement()

    def _check_placement(self) -> None:
        places = self.block_input_placement
        if isinstance(places, list):
            self.block_input_placement = places = tuple(places)  # YAML gives a list
        if not isinstance(places, tuple) or any(p not in BLOCK_INPUT_PLACES for p in places):
            raise ValueError(
                f"{self.named('block_input_placement')}={places!r} is invalid; give one place per decoder "
                f"layer, each one of "
                f"{', '.join(BLOCK_INPUT_PLACES)}, e.g. [ram, recompute, ram, gpu]"
            )
        if not places:
            return
        if places[0] == "recompute":
            raise ValueError(
                "block_input_placement: layer 0's input cannot be recomputed (nothing comes before it); "
                "place it on the gpu, in ram or on disk"
            )
        for name in ("gpu_block_inputs", "recompute_block_inputs"):
            if getattr(self, name) != self.default(name):
                raise ValueError(
                    f"{name} and block_input_placement both place block inputs; give only block_input_placement"
                )
