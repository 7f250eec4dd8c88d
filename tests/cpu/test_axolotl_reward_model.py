"""Axolotl's reward models: ``reward_model: true`` with ``model_type:
AutoModelForSequenceClassification``, ``num_labels: 1`` and ``bradley_terry.chat_template``
pairs, trained with TRL's reward trainer (Bradley-Terry loss, ``center_rewards_coefficient``);
classification heads otherwise still refused."""

import json
import math

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("yaml")

from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigProblemsError  # noqa: E402
from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.data.preference import reward_examples  # noqa: E402
from offloadkit.data.sft import CHATML_TEMPLATE, DatasetSpec  # noqa: E402
from offloadkit.models.zoo import build_llama  # noqa: E402
from tests.cpu.test_axolotl_keys import _axolotl, _run  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401


def _pairs(path, n=24):
    path.write_text(
        "".join(
            json.dumps(
                {
                    "system": "" if i % 2 else "Answer briefly.",
                    "input": f"What is {i} plus {i}?",
                    "chosen": f"{2 * i}.",
                    "rejected": f"Perhaps {i}, or so.",
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return str(path)


def _reward_config(tmp_path, **keys):
    folder = tmp_path / "base"
    build_llama("tiny", vocab_size=259).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    config = _axolotl(
        tmp_path,
        base_model=str(folder),
        model_type="AutoModelForSequenceClassification",
        num_labels=1,
        reward_model=True,
        chat_template="chatml",
        datasets=[{"path": _pairs(tmp_path / "pairs.jsonl"), "type": "bradley_terry.chat_template"}],
        adapter=None,
        lora_r=...,
        lora_alpha=...,
        lora_target_linear=...,
    )
    config.pop("model_shape")
    config.update(keys)
    return config


def test_reward_pairs_are_each_sides_conversation_cut_at_seq_len(tmp_path):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE
    spec = DatasetSpec(path=_pairs(tmp_path / "p.jsonl", n=2), type="bradley_terry")
    pairs, cut = reward_examples(spec, tokenizer, seq_len=512)
    assert cut == 0
    assert tokenizer.decode(pairs[0]["chosen_ids"]) == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 0 plus 0?<|im_end|>\n"
        "<|im_start|>assistant\n0.<|im_end|>\n"
    )
    # An empty system message is left out, as Axolotl leaves it out.
    assert tokenizer.decode(pairs[1]["rejected_ids"]).startswith("<|im_start|>user\nWhat is 1 plus 1?")
    short, cut = reward_examples(spec, tokenizer, seq_len=40)
    assert cut == 2 and all(len(ids) <= 40 for pair in short for ids in pair.values())


def test_reward_model_trains_a_one_score_head_on_the_pairs(tmp_path, monkeypatch):
    config = _reward_config(tmp_path, center_rewards_coefficient=0.01, pad_to_sequence_len=True)
    seen, report = _run(tmp_path, monkeypatch, config)
    assert type(seen.args).__name__ == "RewardConfig"
    assert seen.args.center_rewards_coefficient == 0.01 and seen.args.pad_to_multiple_of == 256
    assert report["steps"] == 2 and "reward model (Bradley-Terry) on 24 pairs" in report["notes"]
    # The Bradley-Terry loss of a fresh head is about log 2 (a language-modelling loss of
    # this vocabulary would be about log 259).
    assert abs(report["first_loss"] - math.log(2)) < 0.2
    saved = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "model")
    assert saved.config.num_labels == 1 and saved.config.pad_token_id is not None


@pytest.mark.parametrize(
    "keys, match",
    [
        ({"reward_model": ...}, r"model_type='AutoModelForSequenceClassification': sequence classification heads"),
        ({"num_labels": 2}, r"reward_model=True trains a one-score classifier: .* num_labels: 1"),
        ({"adapter": "lora", "lora_r": 4, "lora_target_linear": True}, r"reward_model=True is trained as a full"),
    ],
)
def test_other_classification_setups_are_refused(tmp_path, keys, match):
    config = _reward_config(tmp_path)
    config.update(keys)
    config = {k: v for k, v in config.items() if v is not ...}
    with pytest.raises(ConfigProblemsError, match=match):
        TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False)
