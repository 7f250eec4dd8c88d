"""``memory_timeline.png``: memory through one training step without and with offloadkit,
overlaid, with each run's phases (forward, backward, optimizer) drawn beneath."""

from __future__ import annotations

from offloadkit.cli.measure import RunMeasure

__all__ = ["plot_timelines"]

GiB = float(1 << 30)
_PHASE_COLORS = {"forward": "#8fbc8f", "backward": "#b39ddb", "optimizer": "#bdbdbd"}
_RUN_COLORS = {"without offloadkit": "tab:red", "with offloadkit": "tab:blue"}


def _why_not(runs: list[RunMeasure], profile_step: int, steps_run: int) -> str | None:
    if any(r.samples for r in runs):
        return None
    if steps_run <= profile_step:
        return (
            f"skipped: the run had {steps_run} steps and the timeline samples step {profile_step}; "
            f"set profile_step below max_steps"
        )
    return "skipped: no memory samples were taken during the profiled step"


def plot_timelines(
    runs: list[RunMeasure], path: str, *, title: str, memory_label: str, profile_step: int, steps_run: int
) -> tuple[str | None, str]:
    """Write the PNG.

    Args:
        runs: the measured runs (those without samples are left out of the plot).
        path: the PNG to write.
        title: the figure title.
        memory_label: what the memory axis shows ("GPU memory allocated", "process RSS").
        profile_step: the sampled step, for the axis label.
        steps_run: optimizer steps the run made (to say why nothing was sampled).

    Returns:
        ``(path, "")`` when written, else ``(None, reason)``.
    """
    reason = _why_not(runs, profile_step, steps_run)
    if reason is not None:
        return None, reason
    from offloadkit.extras import MissingExtraError, require

    try:
        require("matplotlib", "plot", "the memory timeline").use("Agg")
        plt = require("matplotlib.pyplot", "plot", "the memory timeline")
    except MissingExtraError as exc:
        return None, f"skipped: {exc}"
    runs = [r for r in runs if r.samples]
    fig, (ax, strip) = plt.subplots(
        2, 1, figsize=(10, 5.6), sharex=True, gridspec_kw={"height_ratios": [4, 0.32 * len(runs) + 0.25]}
    )
    for run in runs:
        t = [s[0] * 1000 for s in run.samples]
        color = _RUN_COLORS.get(run.label, None)
        peak = max(s[1] for s in run.samples) / GiB
        ax.plot(
            t,
            [s[1] / GiB for s in run.samples],
            color=color,
            lw=1.6,
            label=f"{memory_label}, {run.label} (peak {peak:.3f} GiB)",
        )
        if any(s[2] for s in run.samples):
            ax.plot(
                t,
                [s[2] / GiB for s in run.samples],
                color=color,
                lw=1,
                ls="--",
                label=f"host RAM holding offloaded bytes, {run.label}",
            )
        if any(s[3] for s in run.samples):
            ax.plot(
                t,
                [s[3] / GiB for s in run.samples],
                color=color,
                lw=1,
                ls=":",
                label=f"offloaded bytes on disk, {run.label}",
            )
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)

    seen = set()
    for row, run in enumerate(reversed(runs)):
        for name, start, end in run.phases:
            width = (end - start) * 1000
            label = name if name not in seen else None
            seen.add(name)
            strip.broken_barh(
                [(start * 1000, width)],
                (row + 0.1, 0.8),
                facecolors=_PHASE_COLORS.get(name, "#eee"),
                edgecolor="white",
                label=label,
            )
            if width > 0.06 * max(s[0] for s in run.samples) * 1000:
                strip.text(start * 1000 + width / 2, row + 0.5, name, ha="center", va="center", fontsize=7)
    strip.set_yticks([i + 0.5 for i in range(len(runs))], [r.label for r in reversed(runs)], fontsize=8)
    strip.set_ylim(0, len(runs))
    strip.set_xlabel(f"time in training step {profile_step} (ms)")
    strip.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, ""
