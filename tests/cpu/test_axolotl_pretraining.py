"""Axolotl keys of pretraining configs and older examples: ``pretraining_dataset`` read as
text documents, ``reinit_weights`` (the architecture from random weights), the legacy
``tokens:`` mapping of special tokens, and a vision-language model without a causal-LM class
(Mistral 3) loaded by its image-text-to-text class for its text path."""

import json

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("yaml")

from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigError, ConfigProblemsError  # noqa: E402
from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.models.zoo import build_llama  # noqa: E402
from tests.cpu.test_axolotl_keys import _axolotl, _run  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401


def _texts(path, n=40, column="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(
                json.dumps({column: f"Document {i}. " + "Before we proceed any further, hear me. " * (1 + i % 3)})
                + "\n"
            )
    return str(path)


def _base(tmp_path):
    folder = tmp_path / "base"
    build_llama("tiny", vocab_size=259, seed=1).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


def test_pretraining_dataset_trains_on_its_text_column(tmp_path, monkeypatch):
    data = _texts(tmp_path / "c4.jsonl", column="content")
    entry = {"path": data, "name": "en", "type": "pretrain", "split": "train", "text_column": "content"}
    config = _axolotl(tmp_path, adapter=None, datasets=..., pretraining_dataset=[entry], sample_packing=True)
    cfg = TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False)
    assert cfg.datasets == [{"path": data, "type": "completion", "field": "content"}]
    assert cfg.name("datasets") == "pretraining_dataset"
    _, report = _run(tmp_path, monkeypatch, config)
    assert report["steps"] == 2 and math_finite(report["first_loss"])
    both = _axolotl(tmp_path / "both", pretraining_dataset=[entry])
    with pytest.raises(ConfigProblemsError, match="pretraining_dataset and datasets both name the training data"):
        TrainConfig.from_dict(both, source="axolotl.yaml", cuda=False)
    odd = _axolotl(tmp_path / "odd", datasets=..., pretraining_dataset=[dict(entry, shuffle_buffer=5)])
    with pytest.raises(ConfigProblemsError, match=r"pretraining_dataset\[0\] has unknown keys \['shuffle_buffer'\]"):
        TrainConfig.from_dict(odd, source="axolotl.yaml", cuda=False)
    preference = _axolotl(tmp_path / "rl", datasets=..., pretraining_dataset=[entry], rl="dpo")
    with pytest.raises(ConfigProblemsError, match=r"pretraining_dataset is plain text and rl='dpo'") as caught:
        TrainConfig.from_dict(preference, source="axolotl.yaml", cuda=False)
    assert "type='completion'" not in str(caught.value)  # no value the user did not write


def math_finite(x):
    return x == x and abs(x) < float("inf")


def test_reinit_weights_trains_the_architecture_from_random_weights(tmp_path, monkeypatch):
    base = _base(tmp_path)
    keys = dict(adapter=None, lora_r=..., lora_alpha=..., lora_target_linear=..., base_model=base, model_shape=...)
    seen, _ = _run(
        tmp_path / "re",
        monkeypatch,
        _axolotl(tmp_path / "re", reinit_weights=True, **keys),
        probe=lambda m: m.model.embed_tokens.weight.detach().clone(),
    )
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(base).model.embed_tokens.weight
    assert seen.found.shape == pretrained.shape and not torch.equal(seen.found, pretrained)
    # The architecture as the config overrides it, as the pretrained route reads it.
    shallow, _ = _run(
        tmp_path / "shallow",
        monkeypatch,
        _axolotl(tmp_path / "shallow", reinit_weights=True, model_config={"num_hidden_layers": 1}, **keys),
        probe=lambda m: len(m.model.layers),
    )
    assert shallow.found == 1
    # The seed draws the same weights again.
    again, _ = _run(
        tmp_path / "again",
        monkeypatch,
        _axolotl(tmp_path / "again", reinit_weights=True, **keys),
        probe=lambda m: m.model.embed_tokens.weight.detach().clone(),
    )
    assert torch.equal(again.found, seen.found)
    with pytest.raises(ConfigError, match="reinit_weights=True .* cannot start from quantized weights"):
        TrainConfig.from_dict(
            _axolotl(
                tmp_path / "q",
                reinit_weights=True,
                load_in_4bit=True,
                adapter="qlora",
                base_model=base,
                model_shape=...,
            ),
            source="axolotl.yaml",
            cuda=False,
        )


def test_the_legacy_tokens_mapping_is_special_tokens(tmp_path):
    config = _axolotl(tmp_path, tokens={"pad_token": "<|padding|>", "eos_token": "</s>"})
    cfg = TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False)
    assert cfg.special_tokens == {"pad_token": "<|padding|>", "eos_token": "</s>"} and cfg.tokens is None
    both = _axolotl(tmp_path, tokens={"pad_token": "<p>"}, special_tokens={"pad_token": "<q>"})
    with pytest.raises(ConfigProblemsError, match="tokens and special_tokens are the same setting"):
        TrainConfig.from_dict(both, source="axolotl.yaml", cuda=False)


def test_a_vision_language_model_without_a_causal_lm_class_loads_for_its_text_path(tmp_path):
    from offloadkit.cli.build import _model_class

    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=259,
        head_dim=16,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        patch_size=14,
        image_size=56,
        head_dim=16,
    )
    config = transformers.Mistral3Config(text_config=text, vision_config=vision)
    folder = tmp_path / "mistral3"
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    cfg = TrainConfig.from_dict({"model": str(folder), "compare": False}, cuda=False)
    assert _model_class(cfg, str(folder)) is transformers.AutoModelForImageTextToText
    assert _model_class(cfg, _base(tmp_path)) is transformers.AutoModelForCausalLM


def test_reinit_weights_falls_back_to_the_models_own_attention_as_the_pretrained_route_does(tmp_path):
    """A model without the attention kernel asked for (Gemma 2 has no sdpa) loads with its own
    and a warning on both routes; reinit_weights no longer reports it as unloadable."""
    import warnings

    from offloadkit.cli import build
    from offloadkit.cli.train_config import TrainConfig
    from offloadkit.data import byte_tokenizer
    from offloadkit.testing.families import build_family

    source = tmp_path / "gemma2"
    build_family("gemma2").save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    for reinit in (False, True):
        cfg = TrainConfig.from_dict(
            {"model": str(source), "reinit_weights": reinit, "seq_len": 64, "attn_implementation": "sdpa"}
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = build._from_pretrained(cfg, cfg.model, torch.float32)
        assert model.config._attn_implementation == "eager"
        assert any("has no 'sdpa' attention" in str(w.message) for w in caught), reinit
