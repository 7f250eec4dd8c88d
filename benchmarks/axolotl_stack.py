"""Axolotl's own long-context stack on the model, tokens, optimizer and timing of the rows of
``capacity.py``, so that both can be timed in one run on one GPU.

Each part is a set of Axolotl config keys, applied by Axolotl's code (the axolotl wheel,
imported, nothing re-implemented) at the point of model loading or training where Axolotl
applies it, with the values Axolotl's config validation gives the keys:

  offload           ``gradient_checkpointing: offload``, which Axolotl reads as
                    ``gradient_checkpointing: true`` + ``activation_offloading: true``
                    (``--activation-offloading legacy`` or ``hidden_states`` sets that key
                    instead). For a LoRA model Axolotl's loader turns Hugging Face
                    checkpointing on before the adapter, with its default
                    ``use_reentrant: true`` (``false`` for hidden_states), and its
                    ``ActivationOffloadingMixin`` runs each training step inside TRL's
                    ``OffloadActivations`` (Axolotl's PEFT-aware
                    ``get_lora_act_offloading_ctx_manager``, with its two stream fixes), or,
                    for hidden_states, Axolotl's checkpoint-input offloader. legacy also swaps
                    transformers' checkpoint function for ``hf_grad_checkpoint_offload_wrapper``
                    (``CPU_Offloaded_Gradient_Checkpointer``) through ``PatchManager``, and
                    runs TRL's offloader without streams.
  layer_offloading  ``layer_offloading: true``: ``LayerOffloadingMixin`` builds a
                    ``LayerOffloadManager`` (the frozen weights of every decoder layer in
                    pinned RAM, brought back a layer ahead by its hooks) and wraps each step in
                    its pre/post-step context.
  tiled_mlp         ``tiled_mlp: true`` with ``tiled_mlp_use_original_mlp: true`` (Axolotl's
                    schema asks for it beside ``liger_glu_activation``):
                    ``PatchManager.apply_post_plugin_pre_model_load_patches`` patches the MLP
                    class (Liger's SwiGLU MLP when liger is on) to run sequence shards through
                    Axolotl's ``TiledMLP``; ``--tiled-mlp-num-shards`` is
                    ``tiled_mlp_num_shards`` (unset: Axolotl's own count).
  liger             ``plugins: [axolotl.integrations.liger.LigerPlugin]`` with ``liger_rope``,
                    ``liger_rms_norm``, ``liger_glu_activation`` and
                    ``liger_fused_linear_cross_entropy`` true (the llama keys of Axolotl's
                    Liger usage): ``LigerPlugin.pre_model_load`` before the model is built.

The two trainer mixins run inside a minimal ``transformers.Trainer`` subclass, in the order
``AxolotlTrainer`` lists them, so their own ``__init__`` and ``training_step`` wrap the step;
the innermost ``training_step`` is capacity.py's step (forward with labels, backward), and
AdamW steps after it, as Trainer's loop does. No autocast: the model is bf16, as in
capacity.py's rows.

Model and timing as ``capacity.py run_probe``: ``build_llama`` in bf16 with sdpa, LoRA by
``apply_lora``, ``ids = randint(vocab, (1, seq))``, AdamW lr 1e-5 on the trainable parameters,
warm-up steps, then timed steps (median), peak GPU memory from a reset after warm-up, peak host
RSS sampled. A CUDA OOM is recorded as status "oom".

Needs axolotl 0.19 and trl 1.9 (with addict, and datasets, dill and multiprocess, which the
Liger plugin's import of TRL's ORPO trainer pulls in) and liger-kernel. Two things Axolotl
installs and this runs without: the ``__init__`` files of four Axolotl packages, which import
its whole trainer stack (with evaluate, wandb and pydantic), are skipped and the modules used
are imported as they are; and DeepSpeed, whose TiledMLP Axolotl's tiled forward imports when it
is built but calls only under DeepSpeed, is stood in for during that one call.

Writes ``OUT/axolotl-stack-<shape>-<seq>-<layers>L.json`` (a suffix names parts or an offload
mode other than the default) and prints one markdown row:
| stack | seq | layers | status | step s | tokens/s | peak alloc GiB | peak reserved GiB | host RSS GiB | loss |

  pip install --no-index --no-deps --target /tmp/site AXOLOTL_AND_LIGER_WHEELS
  PYTHONPATH=$PWD:/tmp/site python benchmarks/axolotl_stack.py --shape llama-3-8b --lora-rank 16 \\
      --seq-len 65536 --layers 32 --warmup 1 --steps 2 --out results/

On a CPU (``--device cpu --shape tiny``) only tiled_mlp and offload with
``--activation-offloading hidden_states`` run: TRL's offloader and the legacy checkpointer need
CUDA, LayerOffloadManager offloads only CUDA parameters, and Liger's kernels are Triton.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import time
import types
from importlib import metadata

GiB = float(1 << 30)
PARTS = ("offload", "layer_offloading", "tiled_mlp", "liger")
OFFLOAD_MODES = {"true": True, "legacy": "legacy", "hidden_states": "hidden_states"}
LIGER_KEYS = ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy")
# Package __init__ files that import far more than the modules used here (Axolotl's trainers,
# callbacks and config schema, with datasets, evaluate, wandb and pydantic).
HEAVY_PACKAGES = (
    "axolotl.core.trainers",
    "axolotl.core.trainers.mixins",
    "axolotl.utils.callbacks",
    "axolotl.integrations.liger",
)


# --------------------------------------------------------------------------- Axolotl config
def config_keys(parts, mode: str, num_shards: int | None) -> dict:
    """The keys an Axolotl user writes for ``parts`` (recorded with the result)."""
    keys: dict = {"adapter": "lora"}
    if "offload" in parts:
        if mode == "true":
            keys["gradient_checkpointing"] = "offload"
        else:
            keys.update(gradient_checkpointing=True, activation_offloading=mode)
    if "layer_offloading" in parts:
        keys["layer_offloading"] = True
    if "tiled_mlp" in parts:
        keys.update(tiled_mlp=True, tiled_mlp_use_original_mlp=True)
        if num_shards:
            keys["tiled_mlp_num_shards"] = num_shards
    if "liger" in parts:
        keys["plugins"] = ["axolotl.integrations.liger.LigerPlugin"]
        keys.update(dict.fromkeys(LIGER_KEYS, True))
    return keys


def resolved_config(parts, mode: str, num_shards: int | None, seq: int):
    """``config_keys`` as Axolotl's validation and normalisation leave them: ``offload`` becomes
    checkpointing plus ``activation_offloading: true``, and checkpointing kwargs default to
    reentrant except for hidden_states, which defaults to non-reentrant."""
    from axolotl.utils.dict import DictDefault

    cfg = {
        "model_config_type": "llama",
        "adapter": "lora",
        "sequence_len": seq,
        "tiled_mlp_use_original_mlp": True,
    }
    if "offload" in parts:
        cfg.update(
            gradient_checkpointing=True,
            activation_offloading=OFFLOAD_MODES[mode],
            gradient_checkpointing_kwargs={"use_reentrant": mode != "hidden_states"},
        )
    cfg["layer_offloading"] = "layer_offloading" in parts
    if "tiled_mlp" in parts:
        cfg.update(tiled_mlp=True, tiled_mlp_num_shards=num_shards)
    if "liger" in parts:
        cfg.update(dict.fromkeys(LIGER_KEYS, True))
    return DictDefault(cfg)


# --------------------------------------------------------------------------- imports
def _bare_package(name: str) -> None:
    """Register package ``name`` with its directory but without running its ``__init__``, so
    that its submodules import on their own."""
    if name in sys.modules:
        return
    parent_name, _, leaf = name.rpartition(".")
    parent = importlib.import_module(parent_name)
    path = next(os.path.join(p, leaf) for p in parent.__path__ if os.path.isdir(os.path.join(p, leaf)))
    module = types.ModuleType(name)
    module.__path__ = [path]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = [path]
    sys.modules[name] = module
    setattr(parent, leaf, module)


def import_axolotl() -> types.SimpleNamespace:
    """The Axolotl (and TRL) pieces the parts use; ImportError names what is missing."""
    for name in HEAVY_PACKAGES:
        _bare_package(name)
    from axolotl.core.trainers.mixins.activation_checkpointing import ActivationOffloadingMixin
    from axolotl.core.trainers.mixins.layer_offloading import LayerOffloadingMixin
    from axolotl.integrations.liger.plugin import LigerPlugin
    from axolotl.loaders.patch_manager import PatchManager

    return types.SimpleNamespace(
        ActivationOffloadingMixin=ActivationOffloadingMixin,
        LayerOffloadingMixin=LayerOffloadingMixin,
        LigerPlugin=LigerPlugin,
        PatchManager=PatchManager,
    )


@contextlib.contextmanager
def _deepspeed_stand_in():
    """Axolotl's tiled forward imports DeepSpeed's TiledMLP while it is built and uses it only
    when parameters belong to DeepSpeed; where DeepSpeed is not installed, a stand-in that
    refuses to run fills that import for the one call, and leaves no trace after it."""
    if importlib.util.find_spec("deepspeed") is not None:
        yield
        return
    names = ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.sequence_parallel")
    leaf = "deepspeed.runtime.sequence_parallel.ulysses_sp"
    stubs = {n: types.ModuleType(n) for n in (*names, leaf)}

    class TiledMLP:  # the name Axolotl imports
        @staticmethod
        def apply(*_args, **_kwargs):
            raise RuntimeError("DeepSpeed's TiledMLP runs only under DeepSpeed, which is not installed")

    stubs[leaf].TiledMLP = TiledMLP
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for n in stubs:
            sys.modules.pop(n, None)


def _trainer_class(ax):
    """A Trainer with Axolotl's two offloading mixins in AxolotlTrainer's order (layer
    offloading outside activation offloading), the step of capacity.py innermost."""
    from transformers import Trainer, TrainingArguments

    @dataclasses.dataclass
    class StackArguments(TrainingArguments):
        # The two fields of Axolotl's training arguments the mixins read.
        activation_offloading: bool | str = False
        layer_offloading: bool = False

    class Step(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = model(**inputs).loss
            loss.backward()
            return loss.detach()

    class StackTrainer(ax.LayerOffloadingMixin, ax.ActivationOffloadingMixin, Step):
        pass

    return StackArguments, StackTrainer


# --------------------------------------------------------------------------- what was applied
def applied(parts, model, trainer, cfg) -> dict:
    """What each part left on the model and trainer, read back from them."""
    import transformers.modeling_utils
    from transformers.models.llama import modeling_llama

    base = model.get_base_model()
    layers = base.model.layers
    out: dict = {}
    if "offload" in parts:
        ctx = trainer.activation_offload_context
        out["offload"] = {
            "activation_offloading": cfg.activation_offloading,
            "checkpointed_layers": sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers),
            "use_reentrant": cfg.gradient_checkpointing_kwargs["use_reentrant"],
            "context": type(ctx).__name__,
            "checkpoint_function": transformers.modeling_utils.checkpoint.__name__,
        }
        stats = getattr(ctx, "stats", None)
        if stats is not None:  # the hidden-states offloader counts what it moved
            out["offload"]["stats"] = dataclasses.asdict(stats)
    if "layer_offloading" in parts:
        manager = trainer._layer_offload_manager
        frozen = [p for layer in layers for p in layer.parameters() if not p.requires_grad]
        out["layer_offloading"] = {
            "enabled": manager.enabled,
            "layers": getattr(manager, "n_layers", 0),
            "hooks": len(manager._hooks),
            "frozen_params_on_cpu": sum(p.device.type == "cpu" for p in frozen),
            "frozen_params": len(frozen),
        }
    if "tiled_mlp" in parts:
        mlps = [layer.mlp for layer in layers]
        # Set on each MLP by the tiled forward the first time it runs.
        impls = [getattr(m, "_tiled_mlp_dist_impl", None) for m in mlps]
        out["tiled_mlp"] = {
            "mlp_class": type(mlps[0]).__name__,
            "forward": type(mlps[0]).forward.__name__,
            "num_shards": cfg.tiled_mlp_num_shards or "auto",
            "ran": sum(impl is not None for impl in impls),
            "impl": sorted({impl.__name__ for impl in impls if impl is not None}),
        }
    if "liger" in parts:
        out["liger"] = {
            "norm": type(base.model.norm).__name__,
            "input_layernorm": type(layers[0].input_layernorm).__name__,
            "mlp": type(layers[0].mlp).__name__,
            "causal_lm_forward": type(base).forward.__module__,
            "rotary": modeling_llama.apply_rotary_pos_emb.__module__,
        }
    return out


# --------------------------------------------------------------------------- the run
def run(args, parts) -> dict:
    import torch
    from capacity import grad_norm, time_steps

    from offloadkit.integrations.peft_utils import apply_lora
    from offloadkit.models.zoo import LLAMA_SHAPES, build_llama

    cuda = args.device == "cuda"
    out: dict = {"status": "ok"}
    t_setup = time.perf_counter()
    ax = import_axolotl()
    cfg = resolved_config(parts, args.activation_offloading, args.tiled_mlp_num_shards, args.seq_len)
    from transformers import LlamaConfig

    model_config = LlamaConfig(**{**LLAMA_SHAPES[args.shape], "num_hidden_layers": args.layers})
    patches = ax.PatchManager(cfg=cfg, model_config=model_config)

    # Before the model is built, in the loader's order: checkpointing patches (legacy), plugins'
    # pre_model_load (Liger), then the post-plugin patches (tiled MLP).
    patches._apply_gradient_checkpointing_patches()
    if "liger" in parts:
        ax.LigerPlugin().pre_model_load(cfg)
    with _deepspeed_stand_in():
        patches.apply_post_plugin_pre_model_load_patches()

    model = build_llama(
        args.shape,
        dtype=torch.bfloat16,
        device=args.device,
        attn_implementation="sdpa",
        num_hidden_layers=args.layers,
        max_position_embeddings=max(args.seq_len, 131072),
    )
    model.config.use_cache = False
    if cfg.gradient_checkpointing:  # the loader turns it on for LoRA, before the adapter
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=cfg.gradient_checkpointing_kwargs)
    model.enable_input_require_grads()  # Axolotl's adapter loading does this for every adapter
    model = apply_lora(model, rank=args.lora_rank)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), device=args.device)

    arguments, trainer_cls = _trainer_class(ax)
    with tempfile.TemporaryDirectory() as scratch:
        targs = arguments(
            output_dir=scratch,
            report_to="none",
            use_cpu=not cuda,
            activation_offloading=cfg.activation_offloading or False,
            layer_offloading=cfg.layer_offloading,
        )
        trainer = trainer_cls(model=model, args=targs)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    inputs = {"input_ids": ids, "labels": ids}
    out["setup_s"] = time.perf_counter() - t_setup

    def step():
        loss = trainer.training_step(model, inputs)
        out["grad_norm"] = grad_norm(params)  # the last step's, beside its loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    time_steps(step, args.warmup, args.steps, out, cuda=cuda)
    out["applied"] = applied(parts, model, trainer, cfg)
    if out.get("step_s"):
        out["tokens_per_s"] = args.seq_len / out["step_s"]
    return out


def _versions() -> dict:
    found = {}
    for name in ("axolotl", "trl", "liger-kernel", "peft", "transformers", "accelerate"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _fmt(x, spec=".2f") -> str:
    return "" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--parts", default=None, help=f"comma-separated, of {','.join(PARTS)} (default: all)")
    ap.add_argument(
        "--activation-offloading",
        choices=sorted(OFFLOAD_MODES),
        default="true",
        help="the offload part's activation_offloading value (true: what gradient_checkpointing: offload means)",
    )
    ap.add_argument("--tiled-mlp-num-shards", type=int, default=None, help="tiled_mlp_num_shards (default: unset)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default="axolotl-stack-results")
    args = ap.parse_args(argv)
    if args.lora_rank < 1:
        raise SystemExit("axolotl_stack: the stack is Axolotl's LoRA route; --lora-rank must be at least 1")

    # Parts that need CUDA (streams, CUDA parameters, Triton kernels); the hidden-states
    # offloader runs without an accelerator, leaving CPU tensors where they are.
    cuda_only = {"layer_offloading", "liger"}
    if args.activation_offloading != "hidden_states":
        cuda_only.add("offload")
    if args.parts is None:
        parts = [p for p in PARTS if args.device == "cuda" or p not in cuda_only]
    else:
        parts = [p.strip() for p in args.parts.split(",") if p.strip()]
        unknown = [p for p in parts if p not in PARTS]
        if unknown:
            raise SystemExit(f"axolotl_stack: unknown parts {unknown}; choose from {','.join(PARTS)}")
        if args.device == "cpu" and cuda_only & set(parts):
            raise SystemExit(f"axolotl_stack: {sorted(cuda_only & set(parts))} need CUDA")

    result = {
        "shape": args.shape,
        "seq_len": args.seq_len,
        "layers": args.layers,
        "lora_rank": args.lora_rank,
        "device": args.device,
        "parts": parts,
        "axolotl_keys": config_keys(parts, args.activation_offloading, args.tiled_mlp_num_shards),
        "warmup": args.warmup,
        "steps": args.steps,
    }
    try:
        result.update(run(args, parts))
    except Exception as exc:  # recorded as a result, like capacity.py's probes
        import torch

        status = "oom" if isinstance(exc, torch.cuda.OutOfMemoryError) else "error"
        result.update(status=status, note=f"{type(exc).__name__}: {str(exc)[:300]}")
    result["versions"] = _versions()
    result["axolotl_version"] = result["versions"]["axolotl"]
    from offloadkit.bench.provenance import provenance

    result["provenance"] = provenance()

    suffix = "" if parts == list(PARTS) else "-" + "+".join(parts)
    if "offload" in parts and args.activation_offloading != "true":
        suffix += f"-{args.activation_offloading}"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"axolotl-stack-{args.shape}-{args.seq_len}-{args.layers}L{suffix}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
    label = "axolotl: " + "+".join(parts) + (f" ({args.activation_offloading})" if "offload" in parts else "")
    r = result
    print(
        f"| {label} | {args.seq_len} | {args.layers} | {r['status']} | {_fmt(r.get('step_s'))} | "
        f"{_fmt(r.get('tokens_per_s'), '.0f')} | {_fmt(r.get('peak_allocated_gib'))} | "
        f"{_fmt(r.get('peak_reserved_gib'))} | {_fmt(r.get('host_rss_gib'))} | {_fmt(r.get('loss'), '.4f')} |",
        flush=True,
    )
    if r["status"] == "error":
        print(f"axolotl_stack: {r['note']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
