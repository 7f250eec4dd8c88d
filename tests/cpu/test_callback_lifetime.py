"""OffloadCallback's attachments live as long as the run: a train() that raises never reaches
on_train_end, so what it attached is detached by close(), or by the next train() first."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts  # noqa: E402
from offloadkit.integrations.trainer import OffloadCallback  # noqa: E402
from offloadkit.testing import build_llama  # noqa: E402


class FailOnce(transformers.TrainerCallback):
    def __init__(self):
        self.armed = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.armed and state.global_step == 2:
            self.armed = False
            raise RuntimeError("stopped by the test")


def _trainer(tmp_path, callback):
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=3,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        save_strategy="no",
        remove_unused_columns=False,
    )
    model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa")
    dataset = TokenBlocks(byte_tokenizer(), load_texts(), 32)
    return transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[FailOnce(), callback])


def _offloads_a_training_step(model, manager) -> bool:
    """Whether ``manager`` still takes the activations of a training forward of ``model``."""
    before = manager.collect_stats().offloaded_bytes
    model.train()
    ids = torch.arange(64).remainder(259).view(2, 32)
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return manager.collect_stats().offloaded_bytes > before


@pytest.mark.parametrize("detach", ["close", "next train"])
def test_a_train_that_raises_leaves_nothing_attached(tmp_path, detach):
    callback = OffloadCallback({"activation_offloading": "disk", "disk_dir": str(tmp_path / "acts")})
    trainer = _trainer(tmp_path, callback)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        trainer.train()
    failed = callback.runtime
    manager = failed.manager
    assert _offloads_a_training_step(trainer.model, manager)  # still attached: on_train_end never ran
    if detach == "close":
        callback.close()
        assert callback.runtime is None and callback.report is not None
    else:
        trainer.train()
        assert callback.runtime is None and trainer.state.global_step == 3
    assert failed.manager is None and failed.checkpointing is None
    assert not _offloads_a_training_step(trainer.model, manager)


def test_optimizer_offloading_through_the_callback_says_it_cannot_take_effect(tmp_path):
    """The Trainer makes its optimizer before the first callback runs: the callback cannot
    replace it, and says so rather than leaving the user to believe the state is offloaded."""
    callback = OffloadCallback({"optimizer_offloading": True})
    trainer = _trainer(tmp_path, callback)
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks if not isinstance(c, FailOnce)]
    with pytest.warns(UserWarning, match="optimizer_offloading has no effect through OffloadCallback"):
        trainer.train()
    assert any("optimizer_offloading has no effect" in n for n in callback.report["notes"])
    assert (
        type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer).__name__
        == "AdamW"
    )
