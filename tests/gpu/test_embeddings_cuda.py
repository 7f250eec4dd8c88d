"""The frozen input embedding table in host memory on the GPU (``embedding_offloading``):
the step is bitwise the one with the table on the GPU, also beside activation offloading
under slow copies; the GPU holds the table's bytes less; the model still reads as on the GPU;
``close()`` gives the table GPU memory of its own back, with the same values."""

import copy

import pytest
import torch

from offloadkit.compose import prepare
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, randomize_lora_b, run_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
peft = pytest.importorskip("peft")

SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=65536,  # a 128 MiB table in bf16
)


def _model():
    torch.manual_seed(0)
    model = build_llama(SHAPE, dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    model.config.use_cache = False
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    randomize_lora_b(model)
    model.train()
    return model


@pytest.mark.parametrize("config", [{}, {"gradient_checkpointing": True, "activation_offloading": True}])
def test_the_step_is_bitwise_the_one_with_the_table_on_the_gpu(config, slow):
    reference = _model()
    model = copy.deepcopy(reference)
    batch = make_batch(SHAPE["vocab_size"], 2, 512, device="cuda", seed=1)
    batch["input_ids"][:, -7:] = SHAPE["vocab_size"] - 1  # rows at the table's far end
    ref_runtime = prepare(reference, config)
    loss_ref, grads_ref = run_step(reference, batch, ref_runtime.context())
    table = model.get_input_embeddings().weight
    values = table.detach().clone()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    runtime = prepare(model, {**config, "embedding_offloading": True})
    torch.cuda.synchronize()
    nbytes = table.numel() * table.element_size()
    assert runtime.report()["embedding_offloading"] == {"host_bytes": nbytes}
    assert before - torch.cuda.memory_allocated() == nbytes  # the table's own GPU memory went back
    assert table.device.type == "cuda" and model.device.type == "cuda"
    slow(2_000_000)  # copies slow: offloading's and any the lookup would race
    for _ in range(2):
        loss, grads = run_step(model, batch, runtime.context())
        assert_bitwise_equal(loss, loss_ref, "loss")
        assert_bitwise_equal(grads, grads_ref, "grads")
    assert torch.equal(model.state_dict()["base_model.model.model.embed_tokens.weight"].cpu(), values.cpu())
    host_ptr = runtime.handles["embeddings"].table_host.data_ptr()
    assert table.data_ptr() == host_ptr  # read in place from the pinned copy
    runtime.close()
    torch.cuda.synchronize()
    assert torch.equal(table, values) and table.data_ptr() != host_ptr  # GPU memory of its own again
    ref_runtime.close()
