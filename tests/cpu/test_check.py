"""``offloadkit check``: every problem of a config as one line, a verdict per config, exit
status 0 only when all are ok, and never a traceback; nothing is loaded or created."""

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("yaml")

from offloadkit.cli.main import main  # noqa: E402
from offloadkit.data import byte_tokenizer  # noqa: E402
from offloadkit.testing import build_llama  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(path, text):
    path.write_text(text)
    return path.relative_to(path.parent)  # the tests run from its folder


@pytest.fixture(autouse=True)
def short_paths(tmp_path, monkeypatch, foreign_working_directory):  # noqa: F811 (runs after it)
    """Run from ``tmp_path``: configs and files are named relative to it, as a user would."""
    monkeypatch.chdir(tmp_path)


def _check(capsys, *args):
    code = main(["check", *map(str, args)])
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return code, out.out.splitlines()


def _good(tmp_path, name="good.yaml", extra=""):
    _write(tmp_path / "train.jsonl", "".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(5)))
    return _write(
        tmp_path / name,
        "model_shape: tiny\nseq_len: 32\nmax_steps: 2\ndataset: train.jsonl\noutput_dir: out\n" + extra,
    )


def test_valid_config_is_ok_and_creates_nothing(tmp_path, capsys):
    config = _good(tmp_path)
    code, lines = _check(capsys, config)
    assert code == 0, lines
    assert lines == [f"{config}: ok"]
    assert not (tmp_path / "out").exists()


def test_every_problem_is_one_line(tmp_path, capsys):
    config = _write(
        tmp_path / "bad.yaml",
        "model_shape: tiny\nlerning_rate: 1e-4\nwarmup_steps: -3\ndataset: missing.jsonl\noutput_dir: out\n",
    )
    code, lines = _check(capsys, config)
    assert code == 1
    problems, verdict = lines[:-1], lines[-1]
    assert verdict == f"{config}: 3 problems"
    assert len(problems) == 3, lines
    assert any(": keys: " in line and "'lerning_rate' (did you mean 'learning_rate'?)" in line for line in problems)
    assert any(": warmup_steps: " in line and "must be an integer >= 0" in line for line in problems)
    assert any(": dataset: " in line and "does not exist" in line for line in problems)
    assert all(line.startswith(f"{config}: ") and len(line) <= 200 for line in problems)


def test_non_utf8_and_empty_datasets(tmp_path, capsys):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    _write(tmp_path / "empty.jsonl", "")
    one = _write(tmp_path / "a.yaml", "model_shape: tiny\ndataset: latin.txt\noutput_dir: o\n")
    two = _write(tmp_path / "b.yaml", "model_shape: tiny\ndataset: empty.jsonl\noutput_dir: o\n")
    code, lines = _check(capsys, one, two)
    assert code == 1
    assert any(line.startswith(f"{one}: dataset: ") and "not UTF-8 (byte 3, line 1)" in line for line in lines), lines
    assert any(line.startswith(f"{two}: dataset: ") and "is empty" in line for line in lines), lines
    assert f"{one}: 1 problem" in lines and f"{two}: 1 problem" in lines


def test_axolotl_config(tmp_path, capsys):
    model = tmp_path / "base"
    build_llama("tiny", vocab_size=259).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    _write(tmp_path / "alpaca.jsonl", json.dumps({"instruction": "add", "input": "1 2", "output": "3"}) + "\n")
    text = """\
base_model: base
datasets:
  - path: alpaca.jsonl
    type: alpaca
sequence_len: 64
micro_batch_size: 2
adapter: lora
lora_r: 8
lora_target_linear: true
output_dir: out
"""
    good = _write(tmp_path / "axolotl.yml", text)
    bad = _write(tmp_path / "typo.yml", text.replace("lora_r: 8", "lora_alhpa: 8") + "rl: grpo\n")
    code, lines = _check(capsys, good, bad)
    assert code == 1
    assert f"{good}: ok" in lines
    bad_lines = [line for line in lines if line.startswith(f"{bad}: ")]
    assert any("'lora_alhpa'" in line for line in bad_lines), bad_lines
    assert any(line.startswith(f"{bad}: rl: ") for line in bad_lines), bad_lines
    assert bad_lines[-1] == f"{bad}: 2 problems"


def test_hub_id_not_in_the_cache_and_an_earlier_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # train could not download it
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "report.json").write_text("{}")
    config = _write(tmp_path / "hub.yaml", "model: meta-llama/Llama-3.2-1B\noutput_dir: out\n")
    code, lines = _check(capsys, config)
    assert code == 1
    assert any(
        line.startswith(f"{config}: model: ") and "not in the local Hugging Face cache" in line for line in lines
    ), lines
    assert any(line.startswith(f"{config}: output_dir: ") and "holds an earlier run" in line for line in lines)
    code, lines = _check(capsys, config, "--overwrite")
    assert not any("earlier run" in line for line in lines)
    # Where downloads are allowed, train fetches it: not a problem, said in the verdict.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    code, lines = _check(capsys, config, "--overwrite")
    assert code == 0 and lines == [
        f"{config}: ok (model meta-llama/Llama-3.2-1B is not in the local cache: train downloads it)"
    ], lines


def test_plan_that_does_not_fit_the_budgets(tmp_path, capsys):
    config = _good(tmp_path, extra="offload_plan: auto\n")
    code, lines = _check(capsys, config, "--gpu-gib", "80", "--host-gib", "8", "--disk-gib", "8")
    assert code == 0 and lines[-1].startswith(f"{config}: ok (plan fits: "), lines
    big = _write(tmp_path / "big.yaml", "model_shape: llama-3-8b\nseq_len: 1048576\noutput_dir: o\n")
    code, lines = _check(capsys, big, "--plan", "--gpu-gib", "20", "--host-gib", "8", "--disk-gib", "8")
    assert code == 1
    assert lines[0].startswith(f"{big}: offload_plan: no plan fits 1048576 tokens"), lines


def test_garbage_never_a_traceback_and_fast(tmp_path):
    garbage = _write(tmp_path / "garbage.yaml", "a: [1,\n")
    listing = _write(tmp_path / "list.yaml", "- 1\n- 2\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01model: x\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "offloadkit", "check", garbage, listing, binary, tmp_path / "none.yaml"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    elapsed = time.perf_counter() - start
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert f"{garbage}: 1 problem" in lines and f"{listing}: 1 problem" in lines
    assert f"{binary}: 1 problem" in lines and f"{tmp_path / 'none.yaml'}: 1 problem" in lines
    assert elapsed < 15, elapsed  # no model, no tokenising: a few seconds, mostly imports


@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"dtype": "float16"},
        {"dtype": "float32"},
        {"lora_use_dora": True},
        {"lora_target_modules": ["q_proj", "embed_tokens"]},
    ],
)
def test_the_plan_check_predicts_fused_lora_as_the_run_decides_it(keys):
    """``offloadkit check`` loads no model: its guess at ``fused_lora`` must be what
    ``unfusable_reason`` says of the model the run builds."""
    pytest.importorskip("peft")
    import torch

    from offloadkit.cli.build import load_model, with_lora
    from offloadkit.cli.check import _fuses_every_lora_layer
    from offloadkit.cli.train_config import TrainConfig
    from offloadkit.lora.fused import unfusable_reason

    cfg = TrainConfig.from_dict({"model_shape": "tiny", "seq_len": 32, "lora_rank": 4, **keys}, cuda=False)
    dtype = {"float16": torch.float16, "float32": torch.float32}.get(keys.get("dtype"), torch.bfloat16)
    model, _, _ = load_model(cfg, "cpu", dtype)
    model = with_lora(cfg, model)
    assert _fuses_every_lora_layer(cfg) == (unfusable_reason(model) is None), unfusable_reason(model)


def test_the_plan_check_counts_the_embedding_table_where_the_run_would_keep_it_on_the_gpu():
    from offloadkit.cli.check import _options_as_built
    from offloadkit.cli.train_config import TrainConfig
    from offloadkit.embeddings import EmbeddingOptions
    from offloadkit.planning import resolve_shape

    def table_off_gpu(**keys) -> bool:
        cfg = TrainConfig.from_dict({"model_shape": "tiny", "seq_len": 32, "embedding_offloading": True, **keys})
        options = _options_as_built(cfg, cfg.offload, resolve_shape("llama-3-8b"))
        return next(o for o in options if isinstance(o, EmbeddingOptions)).offload

    assert table_off_gpu(lora_rank=8)
    assert not table_off_gpu(lora_rank=8, lora_modules_to_save=["embed_tokens", "lm_head"])  # it trains
    assert not table_off_gpu(lora_rank=0)  # a full fine-tune trains it
