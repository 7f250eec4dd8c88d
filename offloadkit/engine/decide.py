"""Where a saved tensor goes: every keep/offload rule of the engine, in one place, each
answer a :class:`Decision` with its reason.

The rules, in the order they are asked (the first that keeps a tensor names the reason):

* ``closed``: the manager was closed while a forward begun inside it on another thread
  goes on; its remaining saves stay where they are.
* ``backward``: saved while a backward runs (reentrant checkpointing's recompute, a
  double-backward graph): needed within this backward or kept for a later one, so a round
  trip buys nothing.
* ``excluded``: inside a keep region: modules excluded by the user (``exclude=``, fused
  loss kernels), the last checkpointed block's inputs (backward needs them first), and
  everything after the output head (the loss over full-vocabulary logits, needed first).
  The hooks that open these regions only mark them; the rule is here.
* ``unsupported``: tensor subclasses (DTensor, quantized wrappers) own their layout; sparse,
  conjugate and negative views have none a byte copy could restore.
* ``device``: not on a device type this manager moves.
* ``small``: under ``min_offload_size`` bytes (and empty views, which may sit on a storage
  that cannot be resized).
* ``parameter``: parameter or buffer storage (recognised by storage, not only by type: a
  matmul saves ``weight.t()``, FSDP2 saves views of all-gathered parameters).
* ``placed``: a planned place says "the GPU" (a checkpointed block's input the plan keeps
  on the device, ``block_input_placement``).
* ``budget``: the storage tier refused the bytes (host budget, disk full): the tensor stays
  on the device, with one warning.

Everything else is offloaded, to the planned place when there is one ("ram" or "disk",
which the decision carries to the storage tier), else where the tier puts it.

An output kept for a checkpoint's recompute (a fused attention kernel's output and
log-sum-exp, ``checkpointing/attention.py``) is decided by :func:`decide_output`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from offloadkit.defaults import BLOCK_INPUT_PLACES

__all__ = [
    "KEEP_REASONS",
    "PLACES",
    "Decision",
    "OFFLOAD",
    "REFUSED_BY_STORAGE",
    "decide",
    "decide_output",
    "tensor_rule",
]

KEEP_REASONS = ("closed", "backward", "excluded", "unsupported", "device", "small", "parameter", "placed", "budget")
PLACES = BLOCK_INPUT_PLACES[:3]  # a saved tensor's places (recompute never reaches the engine)


@dataclass(frozen=True)
class Decision:
    """Keep a saved tensor where it is (``reason`` says why) or offload it (``reason`` None),
    to ``where`` ("ram" or "disk") when a plan placed it, else where the storage tier puts it."""

    reason: str | None = None
    where: str | None = None

    @property
    def offload(self) -> bool:
        return self.reason is None


OFFLOAD = Decision()
REFUSED_BY_STORAGE = Decision("budget")
_KEEP = {reason: Decision(reason) for reason in KEEP_REASONS}
_PLACED = {"ram": Decision(where="ram"), "disk": Decision(where="disk"), "gpu": _KEEP["placed"], None: OFFLOAD}


def tensor_rule(t: torch.Tensor, device_types: tuple[str, ...], min_offload_size: int, is_parameter) -> str | None:
    """The rules that read the tensor alone: why ``t`` stays, or None.

    Args:
        t: the saved tensor.
        device_types: device types whose tensors are moved.
        min_offload_size: smallest tensor worth moving, in bytes.
        is_parameter: ``is_parameter(t)`` tells whether ``t`` is parameter or buffer storage.
    """
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        return "unsupported"
    if t.device.type not in device_types:
        return "device"
    if t.layout is not torch.strided or t.is_conj() or t.is_neg():
        return "unsupported"
    if t.numel() == 0 or t.numel() * t.element_size() < min_offload_size:
        return "small"
    if is_parameter(t):
        return "parameter"
    return None


def decide(
    t: torch.Tensor, policy, *, closed: bool, in_backward: bool, excluded: bool, placed: str | None = None
) -> Decision:
    """Where the saved tensor ``t`` goes.

    Args:
        t: the tensor autograd saves.
        policy: the :class:`~offloadkit.engine.policy.OffloadPolicy` (device types, size
            threshold, the parameter storages it tracks).
        closed: the manager is closed.
        in_backward: the save happens while a backward runs on this thread.
        excluded: the save happens inside a keep region (see the module docstring).
        placed: the planned place of the save ("gpu", "ram", "disk"), or None.

    Returns:
        The decision; ``decision.offload`` or ``decision.reason``.
    """
    if closed:
        return _KEEP["closed"]
    if in_backward:
        return _KEEP["backward"]
    if excluded:
        return _KEEP["excluded"]
    reason = tensor_rule(t, policy.device_types, policy.min_offload_size, policy.is_parameter_storage)
    return _PLACED[placed] if reason is None else _KEEP[reason]


def decide_output(t: torch.Tensor, policy, *, closed: bool, placed: str | None = None) -> Decision:
    """Where ``t``, an output kept from a checkpointed block's forward for its recompute (a
    fused attention kernel's output or log-sum-exp), goes.

    The rules that read the tensor are a saved tensor's (:func:`tensor_rule`, with the
    engine's ``min_offload_size``), and so is ``closed``; the answer means something else:

    * offload: the output waits in storage, an entry like a saved tensor's;
    * ``small``: held on the device as it is (too small to be worth a copy each way);
    * any other reason (``closed``, ``unsupported``, ``device``, ``parameter``), and the
      storage's refusal (``budget``): not kept at all, the recompute runs the kernel again.

    A saved tensor that stays on the device costs nothing autograd would not hold anyway; an
    output that stays costs memory the recompute would otherwise rebuild. So the rules that
    keep a save where it is because a round trip buys nothing (``backward``, ``excluded``,
    a block placed on "gpu") do not apply: such an output goes where the storage tier puts it.
    A block placed in "ram" or "disk" has its outputs placed with its input.

    Args:
        t: the output (a DTensor's local tensor).
        policy: the :class:`~offloadkit.engine.policy.OffloadPolicy`.
        closed: the manager is closed.
        placed: the planned place of the block's input ("gpu", "ram", "disk"), or None.
    """
    if closed:
        return _KEEP["closed"]
    reason = tensor_rule(t, policy.device_types, policy.min_offload_size, policy.is_parameter_storage)
    if reason is not None:
        return _KEEP[reason]
    return OFFLOAD if placed == "gpu" else _PLACED[placed]
