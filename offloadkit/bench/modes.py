"""The one table of memory-saving modes the benchmarks compare.

Two harnesses read it: ``offloadkit bench`` (``bench/harness.py``) enables and disables the
in-process modes on one model side by side; ``benchmarks/capacity.py`` runs one probe per
process and sets the config-route modes up through :func:`~offloadkit.prepare` with the
config a mode builds from the planner's prediction for that probe (``ModeSetup.config``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import psutil
import torch

from offloadkit.api import get_act_offloading_ctx_manager
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.layers import apply_layer_streaming
from offloadkit.longctx.options import LongContextOptions
from offloadkit.models.zoo import LLAMA_SHAPES
from offloadkit.runtime.device import empty_host_cache

__all__ = ["MODES", "CPU_MODES", "PROBE_MODES", "ModeSetup", "ModeHandle", "estimated_activation_bytes"]


@dataclass
class ModeHandle:
    context: Callable[[], contextlib.AbstractContextManager]
    disable: Callable[[], None]
    stats: Callable[[], dict] | None = None
    stats_reset: Callable[[], None] | None = None


@dataclass
class ModeSetup:
    """One mode: how it is set up, and when it cannot run.

    Attributes:
        name: the mode's name in both harnesses.
        enable: ``(model, cfg) -> ModeHandle``: set the mode up in-process (None: config route only).
        skip_reason: ``(cfg) -> str | None``: why it cannot run here.
        config: ``(probe) -> dict``: the :func:`~offloadkit.prepare` config of a config-route
            mode for a probe (``seq_len``, ``host_budget``, ``disk_dir`` and ``predicted``: the
            planner's loss chunks, MLP shards, placement code, horizon, tiled projections).
    """

    name: str
    enable: Callable | None
    skip_reason: Callable | None = None
    config: Callable[[dict], dict] | None = None


def _checkpointing(model, on: bool) -> None:
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()


def _plain(ckpt: bool):
    def enable(model, cfg):
        _checkpointing(model, ckpt)
        return ModeHandle(contextlib.nullcontext, lambda: _checkpointing(model, False))

    return enable


def _storage_kwargs(cfg) -> dict:
    """Where offloadkit modes put activations: the storage tier, and CPU tensors on a CPU run."""
    kwargs: dict = {"offload_cpu_tensors": not cfg.device.startswith("cuda")}
    if cfg.storage != "ram":
        from offloadkit.storage import DiskOptions

        kwargs.update(storage=cfg.storage, disk=DiskOptions(directory=cfg.disk_dir))
    if cfg.host_budget_gib is not None:
        kwargs["host_budget_bytes"] = int(cfg.host_budget_gib * (1 << 30))
    return kwargs


def _offloadkit(ckpt: bool):
    def enable(model, cfg):
        _checkpointing(model, ckpt)
        manager = get_act_offloading_ctx_manager(
            model,
            prefetch=cfg.prefetch,
            prefetch_bytes=cfg.prefetch_bytes,
            max_fwd_stash_size=cfg.max_fwd_stash_size,
            **_storage_kwargs(cfg),
        )

        def disable():
            manager.close()
            _checkpointing(model, False)

        def stats():
            return {**manager.collect_stats().as_dict(), "storage": manager.storage_stats()}

        return ModeHandle(lambda: manager, disable, stats=stats, stats_reset=manager.reset_stats)

    return enable


def _save_on_cpu(ckpt: bool):
    def enable(model, cfg):
        _checkpointing(model, ckpt)

        def disable():
            _checkpointing(model, False)
            empty_host_cache()  # give PyTorch's cached pinned blocks back between modes

        return ModeHandle(lambda: torch.autograd.graph.save_on_cpu(pin_memory=True), disable)

    return enable


def _blocks(input_offload: bool, layer_stream: bool, hf_ckpt: bool = False):
    """offloadkit's own checkpointing (optionally offloading block inputs) and/or layer streaming."""

    def enable(model, cfg):
        ckpt = None
        if hf_ckpt:
            _checkpointing(model, True)
        else:
            storage_kw = _storage_kwargs(cfg) if input_offload else {}
            ckpt = apply_activation_checkpointing(
                model, offload_inputs=input_offload, prefetch=cfg.prefetch, **storage_kw
            )
        streamer = apply_layer_streaming(model, depth=cfg.stream_depth) if layer_stream else None

        def disable():
            if streamer is not None:
                streamer.remove()
            if ckpt is not None:
                ckpt.remove()
            _checkpointing(model, False)

        def stats():
            out = {}
            if ckpt is not None and ckpt.offloader is not None:
                out.update(ckpt.offloader.collect_stats().as_dict())
                out["storage"] = ckpt.offloader.storage_stats()
            if streamer is not None:
                st = streamer.collect_stats()
                out["layer_stream"] = {
                    "streamed_bytes": streamer.streamed_bytes,
                    "pool_bytes": cfg.stream_depth * max(layer.nbytes for layer in streamer.layers),
                    "loads": st.loads,
                    "misses": st.misses,
                    "max_resident": st.max_resident,
                    "wait_seconds": st.wait_seconds,
                }
            out.setdefault("offloaded_bytes", 0)
            out.setdefault("wait_seconds", out.get("layer_stream", {}).get("wait_seconds", 0.0))
            out.setdefault("prefetch_hits", 0)
            out.setdefault("prefetch_misses", 0)
            return out

        def reset():
            if ckpt is not None and ckpt.offloader is not None:
                ckpt.offloader.reset_stats()

        return ModeHandle(contextlib.nullcontext, disable, stats=stats, stats_reset=reset)

    return enable


def estimated_activation_bytes(cfg) -> int:
    """Rough bytes autograd saves per step without checkpointing (bf16 Llama, fp32 norms)."""
    shape = LLAMA_SHAPES[cfg.shape]
    tokens = cfg.batch * cfg.seq_len
    per_token_layer = 34 * shape["hidden_size"] + 8 * shape["intermediate_size"]
    return tokens * shape["num_hidden_layers"] * per_token_layer


def _needs_host_ram(cfg) -> str | None:
    need = estimated_activation_bytes(cfg)
    have = psutil.virtual_memory().total
    if need > 0.6 * have:
        return (
            f"offloading every activation needs ~{need / 2**30:.0f} GiB of host RAM; "
            f"this machine has {have / 2**30:.0f} GiB"
        )
    return None


def _needs_gpu(what: str):
    def reason(cfg) -> str | None:
        return None if cfg.device.startswith("cuda") else f"{what} needs a CUDA GPU"

    return reason


def _offload_fits(cfg) -> str | None:
    if cfg.storage == "disk" and not cfg.device.startswith("cuda"):
        return None  # CPU activations go to files, not to more RAM
    return _needs_host_ram(cfg)


def _long_context(p: dict) -> dict:
    """The chunked loss and the tiling the planner chose for a probe."""
    return {
        "tiled_projections": bool(p.get("tiled_projections")) and p["mlp_shards"] > 1,
        "chunked_cross_entropy": True,
        "chunked_cross_entropy_num_chunks": p["loss_chunks"],
        "tiled_mlp": p["mlp_shards"] > 1,
        "tiled_mlp_num_shards": p["mlp_shards"] if p["mlp_shards"] > 1 else None,
        **LongContextOptions.config_keys(head_groups=p.get("head_groups") if (p.get("head_groups") or 1) > 1 else None),
    }


def _everything_config(probe: dict) -> dict:
    p = probe["predicted"]
    horizon = p.get("horizon")
    config = {
        "gradient_checkpointing": True,
        "activation_offloading": "disk",
        "disk_tiering": True,
        "host_budget_bytes": probe["host_budget"],
        "layer_offloading": True,
        # The planner's horizon; without one, deeper when some inputs come from disk.
        "activation_loading_horizon": horizon if horizon is not None else 4 if "d" in p["placement"] else 2,
        **_long_context(p),
    }
    dropped = tuple(i for i, c in enumerate(p["placement"]) if c == "x")
    if dropped:
        config["recompute_block_inputs"] = dropped
    if p.get("keep_attention"):
        config |= CheckpointOptions.config_keys(keep_attention=p["keep_attention"])
    if probe.get("disk_dir"):
        config["disk_dir"] = probe["disk_dir"]
    return config


def _in_gpu_config(probe: dict) -> dict:
    return {"gradient_checkpointing": True, "activation_offloading": False, **_long_context(probe["predicted"])}


def _auto_config(probe: dict) -> dict:
    return {"offload_plan": "auto", "seq_len": probe["seq_len"], "host_budget_bytes": probe["host_budget"]}


def _probe_only(cfg) -> str:
    return "a planned config-route mode: run it with benchmarks/capacity.py"


MODES: dict[str, ModeSetup] = {
    "none": ModeSetup("none", _plain(False)),
    "ckpt": ModeSetup("ckpt", _plain(True)),
    "ckpt+offload": ModeSetup("ckpt+offload", _offloadkit(True)),
    "offload": ModeSetup("offload", _offloadkit(False), _offload_fits),
    "ckpt+save_on_cpu": ModeSetup(
        "ckpt+save_on_cpu", _save_on_cpu(True), _needs_gpu("save_on_cpu (GPU to CPU copies)")
    ),
    "save_on_cpu": ModeSetup(
        "save_on_cpu",
        _save_on_cpu(False),
        lambda cfg: _needs_gpu("save_on_cpu (GPU to CPU copies)")(cfg) or _needs_host_ram(cfg),
    ),
    "ok_ckpt": ModeSetup("ok_ckpt", _blocks(False, False)),
    "ckpt+input_offload": ModeSetup("ckpt+input_offload", _blocks(True, False)),
    "ckpt+layer_stream": ModeSetup(
        "ckpt+layer_stream", _blocks(False, True, hf_ckpt=True), _needs_gpu("layer streaming")
    ),
    "ckpt+input_offload+layer_stream": ModeSetup(
        "ckpt+input_offload+layer_stream", _blocks(True, True), _needs_gpu("layer streaming")
    ),
    # offloadkit checkpointing + block inputs offloaded (pinned RAM up to the host budget, then
    # disk, or dropped and replayed where the plan says) + layer streaming + chunked loss + tiled MLP.
    "everything": ModeSetup("everything", None, _probe_only, _everything_config),
    # everything's checkpointing, chunked loss and tiling, nothing offloaded or streamed: what
    # the offloading machinery costs.
    "in_gpu": ModeSetup("in_gpu", None, _probe_only, _in_gpu_config),
    # whatever ``offload_plan: auto`` chooses.
    "auto": ModeSetup("auto", None, _probe_only, _auto_config),
}
CPU_MODES = ("none", "ckpt", "ckpt+offload", "offload")
# The modes benchmarks/capacity.py probes: Hugging Face checkpointing and the config routes.
PROBE_MODES = ("ckpt", "everything", "in_gpu", "auto")
