"""The timeline plot: training step against wall time, preemptions and restarts marked, lost work shaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COLORS = {
    "completed": "tab:green",
    "preempted": "tab:orange",
    "crashed": "tab:red",
    "lost": "tab:purple",
    "hung": "tab:brown",
    "rolled_back": "tab:pink",
    "cancelled": "tab:blue",
}


@dataclass
class AttemptTrace:
    attempt: int
    outcome: str
    started_at: float
    ended_at: float
    steps: list[tuple[float, int]] = field(default_factory=list)  # (epoch s, step) as reported
    durable_step: int | None = None
    resumed_from: int | None = None


def plot_timeline(traces: list[AttemptTrace], title: str, out: Path) -> Path:
    """Write the PNG and return its path."""
    plt = _pyplot()
    t0 = min((t.started_at for t in traces), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    for tr in traces:
        color = COLORS.get(tr.outcome, "tab:gray")
        xs = [t - t0 for t, _ in tr.steps]
        ys = [s for _, s in tr.steps]
        if xs:
            ax.plot(xs, ys, color=color, lw=1.8, label=f"attempt {tr.attempt}: {tr.outcome}")
        ax.axvline(tr.started_at - t0, color="tab:blue", ls=":", lw=1)
        if tr.outcome != "completed":
            end = tr.ended_at - t0
            ax.axvline(end, color=color, ls="--", lw=1.2)
            top = ys[-1] if ys else 0
            low = tr.durable_step if tr.durable_step is not None else (tr.resumed_from or 0)
            if top > low:  # steps trained after the last durable checkpoint: redone by the next attempt
                since = next((x for x, y in zip(xs, ys, strict=True) if y >= low), end)
                ax.fill_between([since, end], low, top, color="tab:red", alpha=0.15, lw=0)
    ax.set_xlabel("wall time since the first attempt (s)")
    ax.set_ylabel("training step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    handles += [
        plt.Line2D([], [], color="tab:blue", ls=":", lw=1),
        plt.Line2D([], [], color="tab:orange", ls="--", lw=1.2),
        plt.Rectangle((0, 0), 1, 1, color="tab:red", alpha=0.15),
    ]
    labels += ["worker started", "worker lost (preempted / crashed)", "lost work (redone)"]
    ax.legend(handles, labels, loc="upper left", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported when a plot is drawn: 0.4 s of every controller's
    and CLI command's start otherwise (measured with -X importtime), most of which never plot."""
    import matplotlib

    matplotlib.use("Agg")  # no display on workers and CI; must precede pyplot
    import matplotlib.pyplot as plt

    return plt
