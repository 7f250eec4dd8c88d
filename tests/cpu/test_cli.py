"""The ``offloadkit`` command as a user runs it, in a subprocess: the default run, Axolotl
configs, errors before training, the CPU bench, and the everyday options. Every run is
checked for its exit code and for the absence of a traceback."""

import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

transformers = pytest.importorskip("transformers")

from offloadkit.data import byte_tokenizer, load_texts  # noqa: E402
from offloadkit.testing import build_llama  # noqa: E402
from tests.cpu.workdir import foreign_working_directory  # noqa: E402, F401

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    # The package under test, whatever the working directory of the command.
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)


def _cli(*args, cwd=None, timeout=600):
    env = _env()
    proc = subprocess.run(
        [sys.executable, "-m", "offloadkit", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def _one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("offloadkit: error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "train:" not in proc.stderr  # stopped before the first step
    return lines[0]


def _tiny(tmp_path, extra="", name="run.yaml", **keys):
    base = {
        "model_shape": "tiny",
        "seq_len": 32,
        "batch_size": 2,
        "max_steps": 2,
        "compare": "false",
        "output_dir": tmp_path / "out",
        "activation_offloading": "disk",
        "disk_dir": tmp_path,
    }
    base.update(keys)
    path = tmp_path / name
    path.write_text("".join(f"{k}: {v}\n" for k, v in base.items()) + extra)
    return path


def test_default_run_compares_learns_and_saves_a_model(tmp_path):
    start = time.perf_counter()
    proc = _cli("train", "--output-dir", tmp_path / "out", cwd=tmp_path)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    comparison = report["comparison"]
    assert comparison["status"] == "ok"
    without, with_ = comparison["peak_bytes"]
    assert with_ < without  # offloadkit's run needs less memory for the same step
    assert all(comparison["median_step_s"])
    assert report["final_loss"] < 0.5 * report["first_loss"]  # it learns
    assert report["fine_tune"] == "full fine-tune" and report["checkpointing_active"]
    assert re.search(
        r"peak memory \(process RSS\) \d+\.\d+ -> \d+\.\d+ GiB \(-\d+%\), "
        r"step time \d+\.\d+ \(\d+\.\d+-\d+\.\d+\) -> \d+\.\d+ \(\d+\.\d+-\d+\.\d+\) s",
        proc.stdout,
    ), proc.stdout
    assert "each side measured in a process of its own" in proc.stdout
    phases = {p[0] for p in report["runs"]["with"]["phases"]}
    assert {"forward", "backward", "optimizer"} <= phases
    assert {p[0] for p in report["runs"]["without"]["phases"]} == phases
    assert (out / "memory_timeline.png").stat().st_size > 20_000
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "model")  # reusable: model and tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    assert model.config.vocab_size == len(tokenizer)
    assert wall < 300


def test_step_time_comparison_takes_the_same_steps_on_both_sides(tmp_path):
    """The plain run measures steps 0 to profile_step; the run with offloadkit's figure comes
    from the same steps of its own (not from all of its steps), step 0 left out on both."""
    proc = _cli("train", _tiny(tmp_path, max_steps=6, profile_step=2, compare="true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    without, with_ = report["runs"]["without"]["step_times_s"], report["runs"]["with"]["step_times_s"]
    assert len(without) == 3 and len(with_) == 6
    comparison = report["comparison"]
    assert comparison["status"] == "ok"
    assert comparison["median_step_s"] == [statistics.median(without[1:3]), statistics.median(with_[1:3])]
    assert comparison["step_s_spread"] == [[min(without[1:3]), max(without[1:3])], [min(with_[1:3]), max(with_[1:3])]]
    assert comparison["compared_steps"] == [1, 2]
    assert report["median_step_s"] == statistics.median(with_[1:])  # the whole run's figure is its own
    assert "median of steps 1-2 of each run" in proc.stdout


def test_axolotl_config_trains_with_lora_and_checkpoints(tmp_path):
    model_dir = tmp_path / "base"
    build_llama("tiny", vocab_size=259).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    text = load_texts()[0]
    data.write_text("".join(json.dumps({"text": text[i : i + 400]}) + "\n" for i in range(0, 8000, 400)))
    config = tmp_path / "axolotl.yaml"
    config.write_text(f"""\
base_model: {model_dir}
datasets:
  - path: {data}
    type: completion
sequence_len: 32
micro_batch_size: 2
gradient_accumulation_steps: 2
num_epochs: 1
max_steps: 4
learning_rate: 2e-4
lr_scheduler: cosine
warmup_steps: 1
optimizer: adamw_torch
adapter: lora
lora_r: 4
lora_alpha: 8
lora_dropout: 0.0
lora_target_linear: true
bf16: false
seed: 1
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
activation_offloading: disk
disk_dir: {tmp_path}
output_dir: {tmp_path / "out"}
logging_steps: 1
save_steps: 2
sample_packing: true
wandb_project: my-project
load_in_8bit: false
compare: false
""")
    proc = _cli("train", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "do not change the training" in line]
    assert len(warned) == 1 and warned[0].endswith("are not used: wandb_project"), proc.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any(" packed into " in note for note in report["notes"])  # sample_packing: true is honoured
    assert report["fine_tune"] == "LoRA r=4" and report["steps"] == 4 and report["dtype"] == "float32"
    assert report["offload"]["config"]["gradient_checkpointing"] and report["checkpointing_active"]
    assert report["offloaded"]["activations_to_disk_bytes_per_step"] > 0
    assert (tmp_path / "out" / "checkpoint-2").is_dir() and (tmp_path / "out" / "checkpoint-4").is_dir()
    adapter = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8


def test_axolotl_unknown_key_is_one_line_with_a_suggestion(tmp_path):
    config = tmp_path / "axolotl.yaml"
    config.write_text("base_model: /models/x\nmicro_batch_sise: 2\n")
    _one_line_error(_cli("train", config), "unknown key 'micro_batch_sise'", "did you mean 'micro_batch_size'?")


def _read_only_dir(tmp_path):
    if os.geteuid() != 0:
        path = tmp_path / "read-only"
        path.mkdir()
        path.chmod(0o500)
        return path
    if os.path.isdir("/sys") and not os.access("/sys", os.W_OK | os.X_OK) or _mkdir_fails("/sys/offloadkit-probe"):
        return "/sys/offloadkit-probe"  # root can write anywhere but a read-only mount
    pytest.skip("no read-only directory available to root here")


def _mkdir_fails(path):
    try:
        os.mkdir(path)
    except OSError:
        return True
    os.rmdir(path)
    return False


def test_output_dir_that_is_a_file_or_read_only_fails_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _one_line_error(_cli("train", _tiny(tmp_path, output_dir=blocker)), f"output_dir={str(blocker)!r} is a file")
    _one_line_error(_cli("train", _tiny(tmp_path, output_dir=blocker / "sub")), "output_dir=", "cannot be written")
    read_only = _read_only_dir(tmp_path)
    _one_line_error(
        _cli("train", _tiny(tmp_path, output_dir=f"{read_only}/out")),
        "cannot be written",
        "choose a writable directory",
    )


def test_disk_dir_that_is_a_file_or_read_only_fails_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _one_line_error(
        _cli("train", _tiny(tmp_path, disk_dir=blocker)), f"disk_dir={str(blocker)!r} is a file", "writable directory"
    )
    read_only = _read_only_dir(tmp_path)
    _one_line_error(_cli("train", _tiny(tmp_path, disk_dir=read_only)), "disk_dir=", "cannot be written")


def test_other_mistakes_fail_before_training(tmp_path):
    _one_line_error(
        _cli("train", _tiny(tmp_path, dataset="[a.jsonl, b.jsonl]")),
        "dataset=['a.jsonl', 'b.jsonl'] must be one file path",
    )
    _one_line_error(_cli("train", _tiny(tmp_path), "--max-steps", "0"), "--max-steps=0 must be an integer >= 1")
    no_tokenizer = tmp_path / "model-only"
    build_llama("tiny", vocab_size=259).save_pretrained(no_tokenizer)
    line = _one_line_error(
        _cli("train", _tiny(tmp_path, model=no_tokenizer)), "holds no tokenizer", "tokenizer.save_pretrained"
    )
    assert line.rstrip().endswith("or set tokenizer: DIR")  # a whole sentence
    records = tmp_path / "train.json"
    records.write_text(json.dumps([{"body": "some text"}] * 50))
    _one_line_error(_cli("train", _tiny(tmp_path, dataset=records)), "no 'text' field", "set text_field")
    _one_line_error(
        _cli("train", _tiny(tmp_path, resume_from_checkpoint="true")),
        "resume_from_checkpoint=true but output_dir=",
        "set save_steps",
    )


def test_json_dataset_trains_on_its_records(tmp_path):
    records = tmp_path / "train.json"
    text = load_texts()[0]
    records.write_text(json.dumps([{"body": text[i : i + 300]} for i in range(0, 6000, 300)]))
    proc = _cli("train", _tiny(tmp_path, dataset=records, text_field="body"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["steps"] == 2


def test_config_option_version_and_resume(tmp_path):
    proc = _cli("--version")
    assert proc.returncode == 0 and re.fullmatch(r"offloadkit \d+\.\d+\.\d+\s*", proc.stdout)
    config = _tiny(tmp_path, max_steps=4, save_steps=2)
    proc = _cli("train", "--config", config)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "checkpoint-4").is_dir()
    proc = _cli("train", "--config", config, "--max-steps", 6, "--resume-from-checkpoint")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["steps"] == 2 and report["losses"][0][0] == 5  # steps 5 and 6 only
    state = json.loads((tmp_path / "out" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    _one_line_error(_cli("train", config, "--config", tmp_path / "other.yaml"), "two config files given")


def test_report_to_tensorboard(tmp_path):
    config = _tiny(tmp_path, report_to="tensorboard")
    proc = _cli("train", config)
    if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
        _one_line_error(proc, "report_to='tensorboard'", "pip install tensorboard")
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [f for _, _, files in os.walk(tmp_path / "out") for f in files if f.startswith("events.out.tfevents")]
    assert events


def test_plot_note_when_the_run_is_shorter_than_the_profiled_step(tmp_path):
    proc = _cli("train", _tiny(tmp_path, max_steps=1, profile_step=5))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any("profile_step 5 is past the run's 1 steps; step 0 is measured" in n for n in report["notes"])
    assert (tmp_path / "out" / "memory_timeline.png").exists()


def _ctrl_c_reaches_it() -> None:
    # A suite started in the background of a non-interactive shell inherits SIGINT ignored,
    # and so would the command: give it the disposition a terminal's Ctrl-C meets.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_when(config, marker: bytes):
    proc = subprocess.Popen(
        [sys.executable, "-m", "offloadkit", "train", str(config)],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_env(),
        preexec_fn=_ctrl_c_reaches_it,
    )
    seen = b""
    deadline = time.monotonic() + 180
    os.set_blocking(proc.stderr.fileno(), False)
    while marker not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen.decode()
        seen += proc.stderr.read() or b""
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=120)
    return proc, out.decode(), (seen + (rest or b"")).decode()


def test_ctrl_c_while_the_comparison_measures_keeps_the_report(tmp_path):
    config = _tiny(tmp_path, max_steps=40, profile_step=39, seq_len=128, compare="true")
    proc, out, stderr = _interrupt_when(config, b"again without offloadkit")
    assert proc.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stderr and "\noffloadkit: \n" not in stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["comparison"]["status"] == "skipped" and "interrupted" in report["comparison"]["note"]
    assert (tmp_path / "out" / "model").is_dir() and (tmp_path / "out" / "memory_timeline.png").exists()


def test_interrupted_message_on_its_own_line(tmp_path):
    # save_steps far ahead: the only checkpoint is the one Ctrl-C saves, at the step it stops.
    config = _tiny(tmp_path, max_steps=100000, seq_len=64, save_steps=50000)
    env = _env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "offloadkit", "train", str(config)],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        preexec_fn=_ctrl_c_reaches_it,
    )
    seen = b""
    deadline = time.monotonic() + 120
    os.set_blocking(proc.stderr.fileno(), False)
    while b"train:" not in seen or b"step/s" not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen.decode()
        seen += proc.stderr.read() or b""
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=60)
    stderr = (seen + (rest or b"")).decode()
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    stopped = re.search(
        r"\noffloadkit: interrupted at step (\d+) of 100000; the last checkpoint is (\S+/checkpoint-(\d+)): "
        r"continue with --resume-from-checkpoint\n?$",
        stderr,
    )
    assert stopped and stopped[1] == stopped[3], stderr[-500:]
    state = json.loads((tmp_path / "out" / f"checkpoint-{stopped[1]}" / "trainer_state.json").read_text())
    assert state["global_step"] == int(stopped[1]) and stopped[2] == str(tmp_path / "out" / f"checkpoint-{stopped[1]}")
    assert not [d for d in os.listdir(tmp_path) if d.startswith("offloadkit-")]  # spill directory removed


def test_bench_without_gpu_runs_on_cpu_with_the_disk_tier(tmp_path):
    if importlib.util.find_spec("torch") and __import__("torch").cuda.is_available():
        pytest.skip("CPU-only behaviour")
    disk = tmp_path / "spill"
    proc = _cli(
        "bench",
        "--shape",
        "tiny",
        "--seq-len",
        128,
        "--steps",
        1,
        "--warmup",
        1,
        "--disk-dir",
        disk,
        "--out",
        tmp_path / "out",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "tiny-128.json").read_text())
    assert report["config"]["storage"] == "disk" and report["config"]["disk_dir"] == str(disk)
    rows = {r["mode"]: r for r in report["results"]}
    assert list(rows) == ["none", "ckpt", "ckpt+offload", "offload"]
    assert all(r["status"] == "ok" and r["loss_bits_equal_reference"] for r in rows.values())
    for mode in ("ckpt+offload", "offload"):
        written = rows[mode]["offload"]["storage"]["disk"]["bytes_written"]
        # Both counters cover the same timed steps (the warm-up's writes are not counted).
        assert (
            0.9 * rows[mode]["offload"]["offloaded_bytes"] <= written <= 1.2 * rows[mode]["offload"]["offloaded_bytes"]
        )
    assert "copy bandwidth" not in proc.stdout  # nothing was measured on a CPU
    # The README's command, on a machine without a GPU: one line, no traceback.
    _one_line_error(
        _cli("bench", "--shape", "llama-3.2-1b", "--seq-len", 16384),
        "run it on a CUDA GPU",
        "--shape small --seq-len 1024",
    )
    _one_line_error(_cli("bench", "--device", "cuda"), "no CUDA GPU is available")
    for args, fragment in (
        (("--seq-len", -5), "--seq-len=-5 must be an integer >= 2"),
        (("--seq-len", 0), "--seq-len=0 must be an integer >= 2"),
        (("--steps", 0), "--steps=0 must be an integer >= 1"),
        (("--lora-rank", -1), "--lora-rank=-1 must be an integer >= 0 (0: full fine-tune)"),
    ):
        _one_line_error(_cli("bench", "--shape", "tiny", *args), fragment)
    _one_line_error(_cli("bench", "--storage", "ram", "--disk-dir", disk), "--disk-dir", "only applies with")


def test_torchrun_two_processes_one_report_with_every_rank(tmp_path):
    """``torchrun --nproc_per_node 2 -m offloadkit train``: DDP through the Trainer (gloo on
    the CPU), one report and one output directory from rank 0, each rank's peaks in it, the
    spill directories removed, LoRA on the built-in model saved once with its base."""
    config = _tiny(tmp_path, max_steps=3, lora_rank=4, logging_steps=1)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "offloadkit",
            "train",
            str(config),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.count("offloadkit train report") == 1, proc.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["world_size"] == 2 and report["parallel"] == "ddp" and [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["activations_to_disk_bytes_per_step"] > 0 for r in report["ranks"])  # both ranks offloaded
    assert report["tokens_per_step"] == 2 * 2 * 32 and report["step_shape"].startswith("2 processes x ")
    assert report["comparison"]["status"] == "skipped"
    assert "rank 1: peak RSS" in proc.stdout
    assert (tmp_path / "out" / "adapter").is_dir() and (tmp_path / "out" / "base").is_dir()
    assert not [d for d in os.listdir(tmp_path) if d.startswith("offloadkit-")]  # spill directories removed


def test_fp16_is_mixed_precision_and_a_nan_loss_stops_the_run(tmp_path):
    proc = _cli("train", _tiny(tmp_path, dtype="float16", max_steps=3, logging_steps=1))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["dtype"].startswith("float16 mixed precision")
    assert all(math.isfinite(loss) for _, loss in report["losses"])
    saved = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert saved.get("dtype", saved.get("torch_dtype")) == "float32"  # fp32 master weights
    # A diverging run: the loss is reported as NaN, nothing is saved, the exit status says so.
    out = tmp_path / "diverged"
    proc = _cli(
        "train",
        _tiny(
            tmp_path,
            name="nan.yaml",
            output_dir=out,
            max_steps=8,
            learning_rate="1e6",
            logging_steps=1,
            activation_offloading="false",
        ),
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("offloadkit: error:")]
    assert len(line) == 1 and re.search(r"the training loss is (nan|inf|-inf) at step \d+", line[0]), proc.stderr
    assert not (out / "model").exists() and not (out / "report.json").exists()


def test_earlier_run_in_output_dir_is_refused_unless_overwritten_or_resumed(tmp_path):
    config = _tiny(tmp_path, max_steps=2, save_steps=2)
    assert _cli("train", config).returncode == 0
    line = _one_line_error(_cli("train", config), "holds an earlier run", "--overwrite", "--resume-from-checkpoint")
    assert "checkpoint-2" in line and "report.json" in line
    # Resuming at or past max_steps: nothing to train, refused before the model is touched.
    before = (tmp_path / "out" / "model" / "model.safetensors").stat().st_mtime_ns
    _one_line_error(
        _cli("train", config, "--resume-from-checkpoint"), "is at step 2 and max_steps is 2", "--max-steps 102"
    )
    assert (tmp_path / "out" / "model" / "model.safetensors").stat().st_mtime_ns == before
    other = _tiny(tmp_path, name="other.yaml", max_steps=3, save_steps=3)
    proc = _cli("train", other, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-3"]


def test_writing_one_offloading_key_keeps_the_other_defaults():
    from offloadkit.cli.train_config import TrainConfig

    for cuda, mode in ((False, "disk"), (True, True)):
        for keys in ({"host_budget_bytes": "1GiB"}, {"activation_loading_horizon": 3}):
            off = TrainConfig.from_dict(keys, cuda=cuda).offload
            assert off.gradient_checkpointing and off.activation_offloading == mode, (keys, off)
        off = TrainConfig.from_dict({"activation_offloading": False}, cuda=cuda).offload
        assert off.gradient_checkpointing and not off.activation_offloading
        # Checkpointing off: the default offloading (of checkpoint inputs) does not become
        # offloading of every activation unless asked for.
        off = TrainConfig.from_dict({"gradient_checkpointing": False}, cuda=cuda).offload
        assert not off.gradient_checkpointing and not off.activation_offloading
        off = TrainConfig.from_dict({"gradient_checkpointing": False, "activation_offloading": mode}, cuda=cuda).offload
        assert off.activation_offloading == mode


def test_optimizers_name_the_package_they_need():
    from offloadkit.cli.preflight import optimizer_package

    assert optimizer_package("adamw_torch_8bit")[0] == "torchao"
    assert optimizer_package("adamw_torch_4bit")[0] == "torchao"
    assert optimizer_package("adamw_bnb_8bit")[0] == "bitsandbytes"
    assert optimizer_package("paged_adamw_32bit")[0] == "bitsandbytes"
    assert optimizer_package("adamw_torch") is None and optimizer_package("adamw_torch_fused") is None


def test_nothing_enabled_is_not_compared_and_the_memory_line_shows_what_acted(tmp_path):
    """With every option off there is nothing to compare (two plain runs would only show
    noise); options that cannot act on a CPU are not listed as acting."""
    off = _tiny(
        tmp_path, name="off.yaml", compare="true", activation_offloading="false", gradient_checkpointing="false"
    )
    proc = _cli("train", off)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["comparison"]["status"] == "skipped" and "no memory option acted" in report["comparison"]["note"]
    assert report["offload_summary"].startswith("nothing")
    ram = _tiny(
        tmp_path,
        name="ram.yaml",
        output_dir=tmp_path / "ram",
        activation_offloading="true",
        layer_offloading="true",
        lora_rank=4,
    )
    proc = _cli("train", ram)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "ram" / "report.json").read_text())
    assert report["offload_summary"] == "gradient checkpointing", report["offload_summary"]
    assert "streaming" not in proc.stdout.split("memory", 1)[1].splitlines()[0]


def test_fp16_loads_what_trains_in_fp32():
    """A full fine-tune trains every weight: fp32 master weights. LoRA trains fp32 adapters
    over a frozen base, which stays in fp16 (half the memory), unless whole modules train."""
    import torch

    from offloadkit.cli.train import load_dtype
    from offloadkit.cli.train_config import TrainConfig

    assert load_dtype(TrainConfig.from_dict({"dtype": "float16"}, cuda=True), True) == torch.float32
    assert load_dtype(TrainConfig.from_dict({"dtype": "float16", "lora_rank": 8}, cuda=True), True) == torch.float16
    assert (
        load_dtype(
            TrainConfig.from_dict({"dtype": "float16", "lora_rank": 8, "lora_modules_to_save": ["lm_head"]}, cuda=True),
            True,
        )
        == torch.float32
    )
    assert load_dtype(TrainConfig.from_dict({}, cuda=True), True) == torch.bfloat16


def test_a_dataset_smaller_than_a_step_is_counted_as_trained(tmp_path):
    """The shipped corpus holds 31 sequences of 2048 tokens: a batch of 64 cannot be filled,
    so a step trains 31 sequences, and tokens per step (and tokens/s) say so."""
    proc = _cli("train", _tiny(tmp_path, seq_len=2048, batch_size=64, max_steps=1), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    blocks = report["tokens_per_step"] // 2048
    assert 0 < blocks < 64 and report["tokens_per_step"] == blocks * 2048
    assert f"filled with the dataset's {blocks} sequences" in report["step_shape"]
    assert any(f"the dataset has {blocks} sequences of 2048 tokens" in n for n in report["notes"])
