"""sample_packing on models whose decoder builds its attention masks without the position ids
(GPT-OSS, AFMoE): the masks are built from the position ids, so that each packed document
attends only to itself, sliding-window layers included; such a model trains packed instead
of being refused, and a model whose layers still mix documents stays refused."""

import json

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("yaml")

from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.data.packing import mask_packed_documents, packing_keeps_documents_apart  # noqa: E402
from tests.cpu.test_axolotl_keys import _axolotl, _run  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401


def _gpt_oss(window=4):
    config = transformers.GptOssConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(config)


def test_masks_from_the_position_ids_keep_each_document_to_itself():
    model = _gpt_oss().eval()
    apart, why = packing_keeps_documents_apart(model)
    assert not apart and why  # its own masks ignore the position ids
    assert mask_packed_documents(model)
    assert packing_keeps_documents_apart(model) == (True, "")
    g = torch.Generator().manual_seed(1)
    first, second = torch.randint(3, 250, (7,), generator=g), torch.randint(3, 250, (9,), generator=g)
    ids = torch.cat([first, second]).unsqueeze(0)
    positions = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits[0]
        alone = [model(input_ids=doc.unsqueeze(0)).logits[0] for doc in (first, second)]
    # Each document as if alone: the sliding window (4 tokens) counted within it, too.
    torch.testing.assert_close(packed[:7], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[7:], alone[1], rtol=1e-5, atol=1e-5)
    # One document per row: the model's own masks, untouched.
    with torch.no_grad():
        plain = model(input_ids=second.unsqueeze(0), position_ids=torch.arange(9).unsqueeze(0)).logits[0]
    torch.testing.assert_close(plain, alone[1], rtol=0, atol=0)


def test_a_model_still_mixing_documents_is_left_as_it_was():
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=259, hidden_size=32, num_hidden_layers=2, state_size=4)
    )
    assert not mask_packed_documents(mamba)
    assert not mamba.get_decoder()._forward_pre_hooks


def test_sample_packing_trains_gpt_oss_packed(tmp_path, monkeypatch):
    folder = tmp_path / "gpt-oss"
    _gpt_oss(window=8).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    config = _axolotl(tmp_path, base_model=str(folder), sample_packing=True, adapter=None, attn_implementation="eager")
    config.pop("model_shape")
    seen, report = _run(tmp_path, monkeypatch, config)
    assert report["steps"] == 2 and any("40 examples packed into" in n for n in report["notes"])
    assert json.loads((tmp_path / "out" / "report.json").read_text())["steps"] == 2
