"""Axolotl's ``rl: dpo`` with its chat_template preference datasets: the pairs read as Axolotl
lays them out, trained with TRL's DPO loss (against the model as loaded) with ``rl_beta``;
other RL types, and preference data without ``rl: dpo``, refused on one line."""

import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("trl")
pytest.importorskip("yaml")

from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigProblemsError  # noqa: E402
from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.data.preference import preference_examples  # noqa: E402
from offloadkit.data.sft import CHATML_TEMPLATE, DatasetSpec  # noqa: E402
from tests.cpu.test_axolotl_keys import _axolotl, _run  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401


def _pairs(path, n=24):
    """Axolotl's layout of fozziethebeat/alpaca_messages_2k_dpo_test, with ShareGPT role names."""
    path.write_text(
        "".join(
            json.dumps(
                {
                    "conversation": [
                        {"from": "system", "value": "Answer briefly."},
                        {"from": "human", "value": f"What is {i} plus {i}?"},
                    ],
                    "good": {"from": "gpt", "value": f"{2 * i}."},
                    "bad": {"from": "gpt", "value": f"{2 * i + 1}, or so."},
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return str(path)


def _dataset(path, **keys):
    entry = {
        "path": path,
        "type": "chat_template.default",
        "field_messages": "conversation",
        "field_chosen": "good",
        "field_rejected": "bad",
        "message_property_mappings": {"role": "from", "content": "value"},
        "roles": {"user": ["human"], "assistant": ["gpt"]},
    }
    entry.update(keys)
    return entry


def test_preference_pairs_are_read_in_axolotls_layout(tmp_path):
    path = _pairs(tmp_path / "pairs.jsonl", n=3)
    spec = DatasetSpec(
        path=path,
        type="chat_template",
        field_messages="conversation",
        field_chosen="good",
        field_rejected="bad",
        message_property_mappings={"role": "from", "content": "value"},
        roles={"user": ["human"], "assistant": ["gpt"]},
    )
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE
    pairs, dropped = preference_examples(spec, tokenizer, seq_len=256)
    assert dropped == 0 and len(pairs) == 3
    assert pairs[2] == {
        "prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 plus 2?"}],
        "chosen": [{"role": "assistant", "content": "4."}],
        "rejected": [{"role": "assistant", "content": "5, or so."}],
    }
    # A pair whose longer side does not fit is dropped: here the rejected answers are longer.
    prompt_and_chosen = tokenizer.apply_chat_template(pairs[0]["prompt"] + pairs[0]["chosen"], tokenize=False)
    fits = len(tokenizer(prompt_and_chosen, add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match=rf"no preference pair fits in seq_len={fits} \(3 longer ones dropped\)"):
        preference_examples(spec, tokenizer, seq_len=fits)


@pytest.mark.parametrize("adapter", ["lora", None])
def test_rl_dpo_trains_the_pairs_with_the_dpo_loss_and_rl_beta(tmp_path, monkeypatch, adapter):
    config = _axolotl(
        tmp_path,
        rl="dpo",
        rl_beta=0.5,
        chat_template="chatml",
        datasets=[_dataset(_pairs(tmp_path / "pairs.jsonl"))],
        val_set_size=4,
        adapter=adapter,
        lora_r=4 if adapter else ...,
        lora_alpha=16 if adapter else ...,
        lora_target_linear=True if adapter else ...,
    )
    seen, report = _run(tmp_path, monkeypatch, config)
    assert type(seen.args).__name__ == "DPOConfig" and seen.args.beta == 0.5 and seen.args.max_length == 256
    assert "4 of 24 pairs held out for evaluation" in report["notes"]
    assert "DPO on 20 preference pairs (beta 0.5)" in report["notes"]
    # The first step's policy is the reference (a frozen copy of the adapters or of the
    # weights as loaded): DPO's loss is log 2 there, whatever the vocabulary
    # (a language-modelling loss of this model would be about log 259).
    assert report["first_loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert report["steps"] == 2


@pytest.mark.parametrize(
    "keys, match",
    [
        ({"rl": "orpo"}, r"rl='orpo': RL and preference training other than DPO and KTO"),
        ({"rl": None}, r"datasets\[0\] has field_chosen, field_rejected: preference data"),
        ({"rl": "dpo", "type": "chat_template.argilla"}, r"datasets\[0\]\.type='chat_template.argilla'"),
        ({"rl": "dpo", "field_prompt": "p"}, r"datasets\[0\] has field_prompt: not read for rl: dpo"),
    ],
)
def test_other_rl_and_preference_data_without_rl_dpo_are_refused(tmp_path, keys, match):
    entry = _dataset(_pairs(tmp_path / "pairs.jsonl", n=2))
    for key in ("type", "field_prompt"):
        if key in keys:
            entry[key] = keys[key]
    config = _axolotl(tmp_path, rl=keys["rl"] or ..., datasets=[entry], chat_template="chatml")
    with pytest.raises(ConfigProblemsError, match=match):
        TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False)


def test_rl_dpo_refuses_packing(tmp_path):
    config = _axolotl(
        tmp_path, rl="dpo", datasets=[_dataset(_pairs(tmp_path / "pairs.jsonl", n=2))], sample_packing=True
    )
    with pytest.raises(ConfigProblemsError, match="sample_packing=True is not done for rl: dpo"):
        TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False)
