"""Checkpointing asked of the Trainer mixin is really on (proven by what autograd saves), on
the installed transformers, on 4.x-style arguments, and when a Trainer ignores the flag;
TRL's own activation_offloading flag leaves exactly one offloading engine active."""

import contextlib
import dataclasses
import warnings

import pytest
from torch.autograd.graph import saved_tensors_hooks

transformers = pytest.importorskip("transformers")

from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts  # noqa: E402
from offloadkit.integrations.hf_args import set_checkpointing  # noqa: E402
from offloadkit.integrations.trainer import ActivationOffloadingMixin  # noqa: E402
from offloadkit.testing import build_llama, make_batch  # noqa: E402


def _model():
    return build_llama("tiny", vocab_size=259, attn_implementation="sdpa", num_hidden_layers=4)


def _disk(tmp_path, checkpointing):
    return {"gradient_checkpointing": checkpointing, "activation_offloading": "disk", "disk_dir": str(tmp_path)}


class OffloadTrainer(ActivationOffloadingMixin, transformers.Trainer):
    pass


def _hf_run(tmp_path, checkpointing):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=2,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        remove_unused_columns=False,
        logging_steps=1,
    )
    trainer = OffloadTrainer(
        model=_model(),
        args=args,
        train_dataset=TokenBlocks(byte_tokenizer(), load_texts(), 64),
        offload_config=_disk(tmp_path, checkpointing),
    )
    trainer.train()
    return trainer


def test_checkpointing_really_on_with_installed_transformers(tmp_path):
    off = _hf_run(tmp_path, False).offload_report
    trainer = _hf_run(tmp_path, True)
    on = trainer.offload_report
    # Checkpointed blocks save only their inputs: far fewer tensors and bytes reach the engine.
    assert on["activations"]["saved_tensors"] * 3 < off["activations"]["saved_tensors"]
    assert on["activations"]["offloaded_bytes"] * 2 < off["activations"]["offloaded_bytes"]
    assert on["config"]["gradient_checkpointing"] is True and on["checkpointing_active"] is True
    assert off["checkpointing_active"] is False
    assert not trainer.args.gradient_checkpointing  # the user's arguments are restored
    assert not any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())


@dataclasses.dataclass
class Legacy4xArgs:
    """The checkpointing fields of transformers 4.x training arguments (no activation_* names)."""

    gradient_checkpointing: bool = False
    gradient_checkpointing_kwargs: dict | None = None


class MiniTrainer:
    """The part of a Hugging Face Trainer the mixin relies on: ``args``, ``model``,
    ``compute_loss`` and ``train``. ``honours`` names the argument field whose value makes
    ``train()`` switch the model's checkpointing on, as the 4.x Trainer did with
    ``gradient_checkpointing``; None ignores every field."""

    honours: str | None = "gradient_checkpointing"

    def __init__(self, model, args, steps=2):
        self.model, self.args, self.steps = model, args, steps
        self.flag_seen = None

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        return model(**inputs).loss

    def train(self):
        self.flag_seen = getattr(self.args, self.honours, None) if self.honours else None
        if self.flag_seen:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
                )
        self.model.train()
        for seed in range(self.steps):
            loss = self.compute_loss(self.model, make_batch(256, 2, 32, seed=seed))
            loss.backward()
            self.model.zero_grad(set_to_none=True)


class Mini(ActivationOffloadingMixin, MiniTrainer):
    pass


def _mini_run(tmp_path, checkpointing, args, trainer_cls=Mini):
    trainer = trainer_cls(_model(), args, offload_config=_disk(tmp_path, checkpointing))
    trainer.train()
    return trainer


def test_checkpointing_really_on_with_4x_style_arguments(tmp_path):
    off = _mini_run(tmp_path, False, Legacy4xArgs()).offload_report
    trainer = _mini_run(tmp_path, True, Legacy4xArgs())
    assert trainer.flag_seen is True  # set under the 4.x name, which that Trainer reads
    assert trainer.offload_report["activations"]["saved_tensors"] * 3 < off["activations"]["saved_tensors"]
    assert trainer.offload_report["checkpointing_active"]
    assert trainer.args == Legacy4xArgs()  # restored after train()


def test_checkpointing_sets_every_field_name():
    args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    restore = set_checkpointing(args, True, {"use_reentrant": False})
    assert args.gradient_checkpointing is True
    if hasattr(args, "activation_checkpointing"):
        assert args.activation_checkpointing is True
        assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
    restore()
    assert not args.gradient_checkpointing


def test_trainer_that_ignores_the_flag_gets_offloadkit_checkpointing(tmp_path):
    class Ignoring(Mini):
        honours = None

    off = _mini_run(tmp_path, False, Legacy4xArgs(), Ignoring).offload_report
    with pytest.warns(UserWarning, match="the Trainer did not switch it on"):
        trainer = _mini_run(tmp_path, True, Legacy4xArgs(), Ignoring)
    report = trainer.offload_report
    assert report["activations"]["saved_tensors"] * 3 < off["activations"]["saved_tensors"]
    assert report["checkpointing_active"] and any("did not switch it on" in n for n in report["notes"])
    assert all("forward" not in m.__dict__ for m in trainer.model.modules())  # detached afterwards


@contextlib.contextmanager
def active_engines(monkeypatch, model):
    """Record, at every decoder layer's forward, the offloading engines whose saved-tensor
    hooks are active (checkpointing's and no-op hooks are not engines)."""
    active: list = []
    seen: list[list[str]] = []
    enter, exit_ = saved_tensors_hooks.__enter__, saved_tensors_hooks.__exit__

    def tracked_enter(self):
        active.append(self)
        return enter(self)

    def tracked_exit(self, *exc):
        active.remove(self)
        return exit_(self, *exc)

    monkeypatch.setattr(saved_tensors_hooks, "__enter__", tracked_enter)
    monkeypatch.setattr(saved_tensors_hooks, "__exit__", tracked_exit)
    handles = [
        layer.register_forward_pre_hook(
            lambda *_: seen.append([type(h).__module__ for h in active if type(h).__name__ == "OffloadActivations"])
        )
        for layer in model.model.layers
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def test_engine_counter_sees_stacked_engines(monkeypatch):
    from offloadkit import OffloadActivations

    model = _model()
    with active_engines(monkeypatch, model) as seen:
        with OffloadActivations(offload_cpu_tensors=True), OffloadActivations(offload_cpu_tensors=True):
            model(**make_batch(256, 1, 16))
    assert seen and all(len(s) == 2 for s in seen)


def test_trl_activation_offloading_flag_leaves_one_engine(tmp_path, monkeypatch):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    class SFT(ActivationOffloadingMixin, trl.SFTTrainer):
        pass

    text = load_texts()[0]
    ds = datasets.Dataset.from_dict({"text": [text[i : i + 200] for i in range(0, 4000, 200)]})
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        max_length=64,
        save_strategy="no",
        packing=False,
        activation_offloading=True,
        gradient_checkpointing=False,
    )
    model = _model()
    with pytest.warns(UserWarning, match="TRL's activation_offloading is switched off"):
        trainer = SFT(
            model=model,
            args=args,
            train_dataset=ds,
            processing_class=byte_tokenizer(),
            offload_config={"activation_offloading": "disk", "disk_dir": str(tmp_path)},
        )
    with active_engines(monkeypatch, model) as seen:
        trainer.train()
    assert seen and all(s == ["offloadkit.engine.offload"] for s in seen), seen
    assert isinstance(trainer.maybe_activation_offload_context, contextlib.nullcontext)
    assert trainer.offload_report["activations"]["offloaded_bytes"] > 0
    assert any("TRL's activation_offloading is switched off" in n for n in trainer.offload_report["notes"])


def test_training_argument_defaults_do_not_override_the_mixin(tmp_path):
    trl = pytest.importorskip("trl")
    from offloadkit.integrations.trainer import resolve_config

    plain = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    # TRL's default activation_offloading=False is not a choice the user made.
    assert resolve_config(None, plain, {"activation_offloading": True}).activation_offloading is True
    chosen = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], activation_offloading=True)
    assert resolve_config(None, chosen, {}).activation_offloading is True


def test_layer_streaming_under_deepspeed_is_refused_with_a_clear_error(tmp_path):
    from offloadkit.config import ConfigError

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    args.deepspeed = {"zero_optimization": {"stage": 3}}  # as a DeepSpeed launch sets it
    data = TokenBlocks(byte_tokenizer(), load_texts(), 32)
    with pytest.raises(ConfigError, match="layer_offloading cannot stream weights that DeepSpeed manages"):
        OffloadTrainer(model=_model(), args=args, train_dataset=data, offload_config={"layer_offloading": True})
    # Activation offloading alone is left to run (measured with ZeRO-2 and ZeRO-3 on an H100).
    OffloadTrainer(model=_model(), args=args, train_dataset=data, offload_config={"activation_offloading": True})
