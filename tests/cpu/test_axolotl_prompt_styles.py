"""Axolotl's instruction prompts in their other styles (``alpaca:chat``, ``alpaca:phi``,
``alpaca:chatml``) and its ``jeopardy`` records: rendered as Axolotl renders them, the loss
on the response and EOS only."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("yaml")

from offloadkit.cli.train_config import TrainConfig  # noqa: E402
from offloadkit.config import ConfigProblemsError  # noqa: E402
from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.data.sft import IGNORE, DatasetSpec, build_examples  # noqa: E402

SYSTEM = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
SYSTEM_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _rendered(spec):
    tokenizer = byte_tokenizer()
    (example,), _ = build_examples(spec, tokenizer, seq_len=1024)
    ids, labels = example
    trained = [t for t, label in zip(ids, labels) if label != IGNORE]
    prompt = ids[: len(ids) - len(trained)]
    return tokenizer.decode(prompt, skip_special_tokens=True), tokenizer.decode(trained)


@pytest.mark.parametrize(
    "style, context, prompt",
    [
        ("chat", "", f"SYSTEM: {SYSTEM}\nUSER: Add 2 and 3.\nASSISTANT:"),
        ("chat", "ints", f"SYSTEM: {SYSTEM_INPUT}\nUSER: Add 2 and 3.\nints\nASSISTANT:"),
        ("phi", "", f"<|system|>\n{SYSTEM}<|end|>\n<|user|>\nAdd 2 and 3.<|end|>\n<|assistant|>\n"),
        ("phi", "ints", f"<|system|>\n{SYSTEM_INPUT}<|end|>\n<|user|>\nAdd 2 and 3.<|end|>ints<|assistant|>"),
        (
            "chatml",
            "",
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
            "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n",
        ),
        (None, "", f"{SYSTEM}\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n"),
    ],
)
def test_alpaca_prompt_styles_render_as_axolotl_does(tmp_path, style, context, prompt):
    path = _write(tmp_path / "a.jsonl", [{"instruction": "Add 2 and 3.", "input": context, "output": "5"}])
    got_prompt, trained = _rendered(DatasetSpec(path=path, type="alpaca", prompt_style=style))
    assert got_prompt == prompt
    assert trained == "5" + byte_tokenizer().eos_token  # the response and EOS only


def test_jeopardy_records_are_an_alpaca_prompt_answered_with_what_is(tmp_path):
    path = _write(tmp_path / "j.jsonl", [{"question": "It doubles 2.", "category": "SUMS", "answer": "4"}])
    prompt, trained = _rendered(DatasetSpec(path=path, type="jeopardy"))
    assert prompt == f"{SYSTEM_INPUT}\n\n### Instruction:\nIt doubles 2.\n\n### Input:\nSUMS\n\n### Response:\n"
    assert trained == "what is 4" + byte_tokenizer().eos_token


@pytest.mark.parametrize(
    "kind, spec",
    [
        ("alpaca:chat", ("alpaca", "chat")),
        ("alpaca:phi", ("alpaca", "phi")),
        ("jeopardy", ("jeopardy", None)),
        ("alpaca:instruct", ("alpaca", None)),
    ],
)
def test_axolotl_typed_styles_map_and_others_are_refused(tmp_path, kind, spec):
    path = _write(tmp_path / "a.jsonl", [{"instruction": "x", "output": "y"}])
    base = {"base_model": None, "sequence_len": 64, "micro_batch_size": 1, "output_dir": str(tmp_path / "o")}
    cfg = TrainConfig.from_dict(dict(base, datasets=[{"path": path, "type": kind}]), source="a.yaml", cuda=False)
    (entry,) = cfg.dataset_specs()
    assert (entry.type, entry.prompt_style) == spec
    with pytest.raises(ConfigProblemsError, match=r"datasets\[0\].type='alpaca:pirate'"):
        TrainConfig.from_dict(
            dict(base, datasets=[{"path": path, "type": "alpaca:pirate"}]), source="a.yaml", cuda=False
        )
