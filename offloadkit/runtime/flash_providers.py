"""FlashAttention-4 behind torch's FA4 provider, whichever flash-attn-4 release is installed.

torch's FA4 provider (``torch.nn.attention._fa4``, private) imports a module by path and calls
its ``_flash_attn_fwd``, unpacking the attention output and its log-sum-exp, and its
``_flash_attn_bwd``, unpacking dq, dk, dv. flash-attn-4 4.0.0b36 returns five values from the
forward (three optional tensors after those two), which torch 2.11 to 2.13 cannot unpack: every
call fails. This module is the path torch's provider is given instead: it calls flash-attn-4's
own functions with the same arguments and returns what torch unpacks. It is registered in
torch's registry under a name of its own, so the ``"FA4"`` entry stays as torch made it.
"""

from __future__ import annotations

import functools
import importlib

__all__ = ["FA4_MODULE", "FA4_PROVIDER", "register_fa4"]

FA4_PROVIDER = "offloadkit-FA4"
FA4_MODULE = "flash_attn.cute.interface"


def _flash_attn_fwd(*args, **kwargs):
    """flash-attn-4's forward: (output, log-sum-exp), whatever else its release returns."""
    out, lse, *_ = importlib.import_module(FA4_MODULE)._flash_attn_fwd(*args, **kwargs)
    return out, lse


def _flash_attn_bwd(*args, **kwargs):
    """flash-attn-4's backward: (dq, dk, dv), without the sink gradient some releases add."""
    dq, dk, dv, *_ = importlib.import_module(FA4_MODULE)._flash_attn_bwd(*args, **kwargs)
    return dq, dk, dv


def register_fa4() -> str | None:
    """Register this module as an FA4 provider in torch's registry (once): its name, or None
    where torch has no FA4 provider to give it to."""
    from torch.nn import attention

    if not hasattr(attention, "register_flash_attention_impl"):
        return None
    if FA4_PROVIDER in attention.list_flash_attention_impls():
        return FA4_PROVIDER
    try:
        from torch.nn.attention import _fa4
    except ImportError:
        return None
    register = getattr(_fa4, "register_flash_attention_fa4", None)
    if register is None:
        return None
    attention.register_flash_attention_impl(FA4_PROVIDER, register_fn=functools.partial(register, module_path=__name__))
    return FA4_PROVIDER
