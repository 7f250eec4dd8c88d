"""The "without -> with offloadkit" comparison: both sides' step times are taken over the same
step indices, whatever the length of each run."""

import statistics

import pytest

pytest.importorskip("transformers")

from offloadkit.cli.compare import saving  # noqa: E402
from offloadkit.cli.measure import RunMeasure  # noqa: E402
from offloadkit.cli.report import _comparison_lines  # noqa: E402


def _report(comparison, profile_step):
    return {"comparison": comparison, "device": "cpu", "profile_step": profile_step}


def test_step_times_compare_the_steps_the_plain_run_measured():
    # The plain run measures steps 0-2 (profile_step 2); the run with offloadkit went on to
    # step 6, its later steps much faster (a warm process): they must not enter the comparison.
    without = RunMeasure("without offloadkit", step_times=[5.0, 1.0, 1.2], peak_bytes=200)
    with_ = RunMeasure("with offloadkit", step_times=[6.0, 1.1, 1.5, 0.2, 0.2, 0.2, 0.2], peak_bytes=100)
    c = saving(without, with_, profile_step=2)
    assert c["compared_steps"] == [1, 2]  # step 0 builds the optimizer state, on both sides
    assert c["median_step_s"] == [statistics.median([1.0, 1.2]), statistics.median([1.1, 1.5])]
    assert c["step_s_spread"] == [[1.0, 1.2], [1.1, 1.5]]
    assert c["time_change"] == pytest.approx(1.3 / 1.1 - 1)
    assert c["peak_change"] == -0.5
    line = "\n".join(_comparison_lines(_report(c, 2)))
    assert "step time 1.100 (1.000-1.200) -> 1.300 (1.100-1.500) s (+18%)" in line
    assert "median of steps 1-2 of each run" in line


def test_profile_step_zero_compares_step_zero_and_a_skipped_plain_run_keeps_the_window():
    c = saving(
        RunMeasure("without offloadkit", step_times=[2.0]), RunMeasure("with offloadkit", step_times=[3.0, 1.0]), 0
    )
    assert c["compared_steps"] == [0, 0] and c["median_step_s"] == [2.0, 3.0]
    skipped = RunMeasure("without offloadkit", status="skipped", note="compare: false")
    c = saving(skipped, RunMeasure("with offloadkit", step_times=[6.0, 1.1, 1.5, 0.2, 0.2]), 2)
    assert c["median_step_s"] == [None, statistics.median([1.1, 1.5])] and c["time_change"] is None
