"""OffloadCallback on TRL's SFTTrainer with TRL's own ``activation_offloading=True`` on the GPU,
where TRL's engine is really built: given the trainer, the callback switches it off and offloads
in its place, with the losses of the SFTTrainer without any offloading."""

import contextlib

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
trl = pytest.importorskip("trl")

from offloadkit.config import ConfigError  # noqa: E402
from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.integrations.trainer import OffloadCallback  # noqa: E402

from .test_trl_cuda import OFFLOAD, STEPS, _common, _losses, _model, _sft_data  # noqa: E402


def _sft(tmp_path, name, trl_offloading, callback_trainer=None):
    args = trl.SFTConfig(**_common(tmp_path, name), max_length=256, packing=False, activation_offloading=trl_offloading)
    trainer = trl.SFTTrainer(model=_model(), args=args, train_dataset=_sft_data(), processing_class=byte_tokenizer())
    callback = None
    if callback_trainer is not None:
        callback = OffloadCallback(OFFLOAD, trainer=trainer if callback_trainer else None)
        trainer.add_callback(callback)
    return trainer, callback


def test_the_callback_switches_trls_engine_off_and_offloads_in_its_place(tmp_path):
    plain, _ = _sft(tmp_path, "plain", trl_offloading=False)
    plain.train()
    both, callback = _sft(tmp_path, "both", trl_offloading=True, callback_trainer=True)
    assert not isinstance(both.maybe_activation_offload_context, contextlib.nullcontext)  # TRL's engine
    both.train()
    assert isinstance(both.maybe_activation_offload_context, contextlib.nullcontext)
    assert callback.report["activations"]["offloaded_bytes"] > 0
    assert len(_losses(plain)) == STEPS and _losses(both) == _losses(plain)


def test_without_the_trainer_the_callback_refuses(tmp_path):
    trainer, callback = _sft(tmp_path, "refused", trl_offloading=True, callback_trainer=False)
    with pytest.raises(ConfigError, match="trainer=trainer"):
        trainer.train()
    assert trainer.state.global_step == 0 and callback.runtime is None
