"""The README's measured figures are data: each is a claim of ``benchmarks/results_index.py``,
read from its result file. These fail when ``benchmarks/results/INDEX.md`` is stale, when a
claim's file is missing, or when a figure in the README's results table differs from the
claim's value."""

import importlib.util
import json
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    name = "offloadkit_results_index"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", "results_index.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


ri = _load()

# A figure, then (after bold markers at most) its claim marker: "3.23<!-- claim: id -->",
# "**10.08**<!-- claim: id -->", "-64%<!-- claim: id -->".
# A sign counts only after a space or "(": in "1.7-1.9x" the hyphen is a range.
_FIGURE = re.compile(r"((?:(?<=[\s(])[-+])?[0-9][0-9,]*(?:\.[0-9]+)?%?)(?:\*\*)?<!-- claim: ([A-Za-z0-9_.-]+) -->")
_MARKER = re.compile(r"<!-- claim: ([A-Za-z0-9_.-]+) -->")


def _results_table() -> list[str]:
    """The table rows of the README's "Measured results" section."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Measured results\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|")]


def readme_figures(rows: list[str]) -> list[tuple[str, str]]:
    """(claim id, figure as written) for every marker in the rows; a marker without a figure
    right before it is an error."""
    out = []
    for row in rows:
        found = _FIGURE.findall(row)
        assert len(found) == len(_MARKER.findall(row)), f"a claim marker without a figure before it: {row}"
        out += [(claim, fig) for fig, claim in found]
    return out


def test_index_is_current():
    with open(os.path.join(REPO, ri.INDEX), encoding="utf-8") as f:
        current = f.read()
    assert current == ri.render(), "benchmarks/results/INDEX.md is stale: run python benchmarks/results_index.py"
    assert ri.main(["--check"]) == 0


def test_check_fails_on_a_stale_or_missing_index(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "INDEX.md"
    stale.write_text(ri.render().replace("| 3.23 s |", "| 3.24 s |"))
    monkeypatch.setattr(ri, "INDEX", str(stale))
    assert ri.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    monkeypatch.setattr(ri, "INDEX", str(tmp_path / "missing.md"))
    assert ri.main(["--check"]) == 1


def test_every_claim_file_exists_and_ids_are_unique():
    ids = [c.id for c in ri.CLAIMS]
    assert len(ids) == len(set(ids))
    missing = [c.file for c in ri.CLAIMS if isinstance(c, ri.Claim) and not os.path.isfile(os.path.join(REPO, c.file))]
    assert not missing, f"claims whose result file is missing: {missing}"
    for claim in ri.CLAIMS:
        if isinstance(claim, ri.Claim):
            assert claim.file.startswith("benchmarks/results/"), claim.id


def test_a_missing_file_or_key_is_an_error():
    with pytest.raises(ri.ClaimError, match="does not exist"):
        ri.values([ri.Claim("gone", "gone", "benchmarks/results/no-such-run.json", "step_s")])
    with pytest.raises(ri.ClaimError, match="no key 'no_such_key'"):
        ri.values([ri.Claim("bad", "bad", "benchmarks/results/weights/weights-offload.json", "no_such_key")])
    with pytest.raises(ri.ClaimError, match="not a claim declared before it"):
        ri.values([ri.Ratio("r", "r", "a", "b")])


def test_readme_figures_equal_the_index():
    values = ri.values()
    by_id = {c.id: c for c in ri.CLAIMS}
    figures = readme_figures(_results_table())
    unknown = sorted({claim for claim, _ in figures} - set(by_id))
    assert not unknown, f"README markers naming no claim: {unknown}"
    wrong = [
        (claim, written, ri.figure(by_id[claim], values[claim]))
        for claim, written in figures
        if written != ri.figure(by_id[claim], values[claim])
    ]
    assert not wrong, f"README figures that differ from the index (claim, README, index): {wrong}"
    unquoted = sorted({c.id for c in ri.CLAIMS if c.quoted} - {claim for claim, _ in figures})
    assert not unquoted, f"claims the README's results table does not quote: {unquoted}"


def test_readme_parser_reads_figures_and_refuses_a_bare_marker():
    row = "| a | 3.23<!-- claim: x --> s, **10.08**<!-- claim: y --> GiB, (-64%<!-- claim: z -->),"
    row += " 1,417,216<!-- claim: w -->, 1.7<!-- claim: lo -->-1.9<!-- claim: hi -->x |"
    assert readme_figures([row]) == [
        ("x", "3.23"),
        ("y", "10.08"),
        ("z", "-64%"),
        ("w", "1,417,216"),
        ("lo", "1.7"),
        ("hi", "1.9"),
    ]
    with pytest.raises(AssertionError, match="without a figure"):
        readme_figures(["| a | about <!-- claim: x --> |"])


def test_lookup_reads_keys_indexes_and_the_one_matching_item():
    data = {"probes": [{"mode": "a", "seq_len": 1, "v": 1.5}, {"mode": "b", "seq_len": 1, "v": 2.5}], "xs": [7, 8]}
    assert ri.lookup(data, "probes[mode=b,seq_len=1].v") == 2.5
    assert ri.lookup(data, "xs[1]") == 8
    assert ri.lookup([{"k": "z", "v": 3}], "[k=z].v") == 3
    with pytest.raises(KeyError, match="2 items match"):
        ri.lookup(data, "probes[seq_len=1].v")
    with pytest.raises(KeyError, match="no item"):
        ri.lookup(data, "xs[2]")


def test_figures_are_written_as_declared():
    assert ri.figure(ri.Claim("a", "a", "f", fmt=",.0f"), 1417216.0) == "1,417,216"
    assert ri.figure(ri.Claim("a", "a", "f", fmt="+.0%"), -0.637) == "-64%"
    assert ri.figure(ri.Ratio("r", "r", "a", "b"), 1.02563) == "1.026"


def test_provenance_is_read_from_the_file_and_beside_it_and_never_made_up(tmp_path, monkeypatch):
    monkeypatch.setattr(ri, "REPO", str(tmp_path))
    monkeypatch.setattr(ri, "RECORDED", {})
    run = tmp_path / "benchmarks" / "results" / "run"
    run.mkdir(parents=True)
    # What a writer of this tree records: everything under "provenance".
    (run / "new.json").write_text(
        json.dumps(
            {
                "step_s": 1.0,
                "provenance": {"commit": "abc1234", "gpu": "NVIDIA H100", "torch": "2.13.0", "command": "x --y"},
            }
        )
    )
    got = ri.provenance("benchmarks/results/run/new.json")
    assert {k: v[0] for k, v in got.items()} == {
        "commit": "abc1234",
        "gpu": "NVIDIA H100",
        "torch": "2.13.0",
        "command": "x --y",
    }
    # An older file: the device and torch keys, an env.txt beside it, nothing about the command.
    (run / "old.json").write_text(json.dumps({"device": "NVIDIA H200", "torch": "2.11.0+cu130"}))
    (run / "env.txt").write_text("2.11.0+cu130 5.17.0 NVIDIA H200\nlibrary code: commit df4d55f\n")
    got = ri.provenance("benchmarks/results/run/old.json")
    assert got["gpu"] == ("NVIDIA H200", "old.json, its keys")
    assert got["commit"] == ("df4d55f", "run/env.txt")
    assert got["command"] is None
    # A README beside it that says the command.
    (run / "README.md").write_text("Command: `bash benchmarks/device/run.sh` (files here are its $OUT).\n")
    assert ri.provenance("benchmarks/results/run/old.json")["command"] == (
        "bash benchmarks/device/run.sh",
        "run/README.md",
    )


def test_env_files_in_both_layouts():
    assert ri._from_env("NVIDIA H100 80GB HBM3, 81559 MiB\nMem: 125\ntorch 2.11.0+cu130 transformers 5.17.0\n") == {
        "gpu": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0+cu130",
    }
    assert ri._from_env("2.11.0+cu130 5.17.0 0.21.0\n") == {"torch": "2.11.0+cu130"}


def test_the_archive_names_folders_that_exist_and_claims_that_do():
    with open(os.path.join(REPO, "benchmarks", "results", "ARCHIVE.md"), encoding="utf-8") as f:
        rows = [line for line in f.read().splitlines() if line.startswith("| `")]
    assert rows
    ids = {c.id for c in ri.CLAIMS}
    for row in rows:
        first = row.split("|")[1]
        for path in re.findall(r"`([^`]+/[^`]*)`", first):
            if "*" not in path:
                assert os.path.exists(os.path.join(REPO, "benchmarks", "results", path)), path
        for claim in re.findall(r"claims? `([a-z0-9-]+)(?:\*)?`", row):
            assert claim in ids or any(i.startswith(claim.rstrip("-")) for i in ids), claim
