"""Axolotl's ``rl: kto`` with its ``llama3.ultra``/``chatml.ultra`` data: labelled completions in
the style's chat format, trained with TRL's KTO loss (``rl_beta``, ``kto_desirable_weight``,
``kto_undesirable_weight``); what KTO cannot run refused on one line."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("trl")
pytest.importorskip("yaml")

from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigProblemsError  # noqa: E402
from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.data.preference import kto_examples  # noqa: E402
from offloadkit.data.sft import DatasetSpec  # noqa: E402
from tests.cpu.test_axolotl_keys import _axolotl, _run  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401


def _records(path, n=24):
    path.write_text(
        "".join(
            json.dumps(
                {
                    "system": "" if i % 2 else "Answer briefly.",
                    "prompt": f"What is {i} plus {i}?",
                    "completion": f"{2 * i if i % 3 else i + 1}.",
                    "label": bool(i % 3),
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return str(path)


def test_kto_records_in_llama3s_format(tmp_path):
    spec = DatasetSpec(path=_records(tmp_path / "k.jsonl", n=2), type="kto", prompt_style="llama3")
    examples, dropped = kto_examples(spec, byte_tokenizer(), seq_len=512)
    assert dropped == 0
    assert examples[0] == {
        "prompt": "<|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 0 plus 0?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "completion": "1.<|eot_id|>",
        "label": False,
    }
    assert examples[1]["prompt"].startswith("<|start_header_id|>user")  # no system turn when it is empty
    chatml = DatasetSpec(path=spec.path, type="kto", prompt_style="chatml")
    assert kto_examples(chatml, byte_tokenizer(), 512)[0][1]["completion"] == "2.<|im_end|>"


def test_rl_kto_trains_with_its_beta_and_weights(tmp_path, monkeypatch):
    data = [{"path": _records(tmp_path / "k.jsonl"), "type": "llama3.ultra", "split": "train"}]
    config = _axolotl(tmp_path, rl="kto", rl_beta=0.5, kto_desirable_weight=0.2, datasets=data, val_set_size=4)
    seen, report = _run(tmp_path, monkeypatch, config)
    assert type(seen.args).__name__ == "KTOConfig"
    assert (seen.args.beta, seen.args.desirable_weight, seen.args.undesirable_weight) == (0.5, 0.2, 1.0)
    assert "4 of 24 examples held out for evaluation" in report["notes"]
    assert "16 of the 24 completions are labelled desirable" in report["notes"]
    assert "KTO on 20 labelled completions (beta 0.5)" in report["notes"]
    assert report["steps"] == 2


@pytest.mark.parametrize(
    "keys, match",
    [
        ({"type": "chat_template"}, r"datasets\[0\].type='chat_template': rl: kto reads the types llama3.ultra"),
        ({"micro_batch_size": 1}, r"batch_size=1 must be 2 or more for rl: kto"),
        ({"rl": ..., "type": "alpaca"}, r"kto_desirable_weight=0.2 weighs KTO's loss; it needs rl: kto"),
    ],
)
def test_what_kto_cannot_run_is_refused(tmp_path, keys, match):
    entry = {"path": _records(tmp_path / "k.jsonl", n=2), "type": keys.pop("type", "llama3.ultra")}
    config = _axolotl(tmp_path, **{"rl": "kto", "kto_desirable_weight": 0.2, "datasets": [entry], **keys})
    with pytest.raises(ConfigProblemsError, match=match):
        TrainConfig.from_dict(config, source="axolotl.yaml", cuda=False)
