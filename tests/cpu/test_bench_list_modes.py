"""``offloadkit bench --list-modes``: every mode with one line of what it does; an unknown
mode's error lists them too."""

from offloadkit.bench.harness import BenchConfig
from offloadkit.bench.modes import CPU_MODES, MODES
from offloadkit.cli.bench import MODE_SUMMARIES, list_modes
from offloadkit.cli.main import main


def test_every_mode_has_a_one_line_summary():
    assert set(MODE_SUMMARIES) == set(MODES)
    for name, summary in MODE_SUMMARIES.items():
        assert summary and "\n" not in summary, name


def test_list_modes_prints_each_mode_and_exits_0(capsys):
    assert main(["bench", "--list-modes"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in MODES:
        row = next(line for line in lines if line.split()[:1] == [name])
        assert MODE_SUMMARIES[name] in row
    assert f"default on a GPU: {';'.join(BenchConfig.modes)}" in out
    assert f"default on a CPU: {';'.join(CPU_MODES)}" in out
    assert out.strip() == list_modes()


def test_list_modes_runs_nothing_whatever_else_is_given(capsys, tmp_path):
    # Nothing is built or written: not even the output directory.
    assert main(["bench", "--list-modes", "--shape", "llama-3-8b", "--out", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "out").exists()
    assert "ckpt+offload" in capsys.readouterr().out


def test_an_unknown_mode_lists_the_modes(capsys):
    assert main(["bench", "--modes", "ckpt;no-such-mode", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown modes ['no-such-mode']" in err
    for name in MODES:
        assert name in err
    assert "--list-modes" in err
