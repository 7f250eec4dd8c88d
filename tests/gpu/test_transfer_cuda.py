"""The one transfer layer on the GPU: every client (RAM tier, disk tier, layer streaming)
copies through the device's copy streams, and all of them together, with every copy
delayed, stay bitwise equal to the run without offloading."""

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.layers import apply_layer_streaming
from offloadkit.storage import DiskOptions
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, randomize_lora_b, run_step
from offloadkit.transfer import copy_stream, copy_streams_created

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
peft = pytest.importorskip("peft")

DEV = "cuda"


def test_three_copy_streams_per_device():
    d2h, h2d, bulk = copy_stream(DEV, "d2h"), copy_stream(DEV, "h2d"), copy_stream(DEV, "h2d_bulk")
    assert len({d2h, h2d, bulk}) == 3
    assert copy_stream(torch.device("cuda", torch.cuda.current_device()), "d2h") == d2h
    with pytest.raises(ValueError, match="direction"):
        copy_stream(DEV, "sideways")


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_streamed_weights_and_offloaded_inputs_share_the_copy_streams(tmp_path, storage, slow):
    model = build_llama("small", dtype=torch.bfloat16, device=DEV, num_hidden_layers=6)
    model = randomize_lora_b(peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))).train()
    batch = make_batch(2048, 2, 512, device=DEV)
    plain = apply_activation_checkpointing(model)
    ref = run_step(model, batch)
    plain.remove()
    created = copy_streams_created()
    slow(2_000_000)  # every copy starts ~1 ms late: a missing wait shows as wrong numbers
    kwargs = {"storage": "disk", "disk": DiskOptions(directory=str(tmp_path))} if storage == "disk" else {}
    handle = apply_activation_checkpointing(model, offload_inputs=True, **kwargs)
    streamer = apply_layer_streaming(model)
    got = run_step(model, batch)
    again = run_step(model, batch)
    assert handle.offloader.stats.offloaded_tensors > 0 and streamer.stats.loads > 0
    streamer.remove()
    handle.remove()
    # Both clients copied through the same streams of this device (three at most: the
    # optimizer state's bulk queue is the third).
    assert copy_streams_created() - created <= 2 and copy_streams_created() <= 3 * torch.cuda.device_count()
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert_bitwise_equal(ref[1], again[1], "second step")
