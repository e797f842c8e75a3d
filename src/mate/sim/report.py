"""Results of the simulation: the check of SPEC §6, the tables, the JSON, the plots.

The check: at every (threshold, processes) the speed-ups must be ordered
Progressive Messages >= message-driven >= message-passing. Equal is allowed, and
a relative difference below `REL_TOL` counts as equal (float noise only: the
model's arithmetic is exact for integer durations and a binary-fraction latency).

The JSON object (``--json``)::

    {"units", "seed", "latency", "thresholds", "processes", "models",
     "workload": {"total", "median", "mean", "min", "max"},
     "rows": [{"threshold", "processes", "speedup_mp", "speedup_md", "speedup_pm",
               "makespan_<m>", "steps_<m>", "splits_<m>" for each model m}],
     "violations": [{"threshold", "processes", "relation"}],
     "verified", "runtime_s"}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mate.sim import MODEL_NAMES, MODELS, Outcome

REL_TOL = 1e-9
LABELS = {"mp": "MP", "md": "MD", "pm": "PM"}


@dataclass(frozen=True)
class Row:
    """The speed-ups of the three models at one (threshold, processes)."""

    threshold: float
    processes: int
    speedup: dict[str, float]
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"threshold": self.threshold, "processes": self.processes}
        for m in MODELS:
            obj[f"speedup_{m}"] = self.speedup[m]
        for m in MODELS:
            out = self.outcomes.get(m)
            if out is not None:
                obj[f"makespan_{m}"] = out.makespan
                obj[f"steps_{m}"] = out.steps
                obj[f"splits_{m}"] = out.splits
        return obj


@dataclass(frozen=True)
class Violation:
    threshold: float
    processes: int
    relation: str  # "PM < MD" or "MD < MP"

    def where(self) -> str:
        return f"threshold {self.threshold:g}, processes {self.processes}"

    def to_json(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "processes": self.processes,
                "relation": self.relation}


def _below(a: float, b: float, rel_tol: float) -> bool:
    """``a < b`` by more than float noise."""
    return a < b - rel_tol * max(abs(a), abs(b))


def check_order(rows: Sequence[Row], rel_tol: float = REL_TOL) -> list[Violation]:
    """Every place where PM >= MD >= MP does not hold, in table order."""
    broken = []
    for row in rows:
        s = row.speedup
        if _below(s["pm"], s["md"], rel_tol):
            broken.append(Violation(row.threshold, row.processes, "PM < MD"))
        if _below(s["md"], s["mp"], rel_tol):
            broken.append(Violation(row.threshold, row.processes, "MD < MP"))
    return broken


def summary_line(rows: Sequence[Row], violations: Sequence[Violation], runtime_s: float) -> str:
    """The last line of the program: ``verified`` or ``NOT verified`` with the places."""
    points = len(rows)
    if not violations:
        return (f"summary: speed-up PM >= MD >= MP at all {points} points: verified "
                f"(simulated in {runtime_s:.1f} s)")
    places = {(v.threshold, v.processes) for v in violations}
    listed = "; ".join(f"{v.relation} at ({v.where()})" for v in violations)
    return (f"summary: speed-up PM >= MD >= MP NOT verified at {len(places)} of {points} "
            f"points: {listed} (simulated in {runtime_s:.1f} s)")


def format_table(threshold: float, rows: Sequence[Row], runtime_s: float) -> str:
    """The speed-ups at one threshold, one line per process count."""
    lines = [f"# threshold {threshold:g}",
             f"{'processes':>9} {'speed-up MP':>12} {'MD':>10} {'PM':>10} {'PM eff.':>8}"]
    for row in rows:
        s = row.speedup
        lines.append(f"{row.processes:>9} {s['mp']:>12.2f} {s['md']:>10.2f} {s['pm']:>10.2f} "
                     f"{s['pm'] / row.processes:>8.3f}")
    lines.append(f"# threshold {threshold:g}: {len(rows) * len(MODELS)} runs in "
                 f"{runtime_s:.2f} s")
    return "\n".join(lines)


def to_json(rows: Sequence[Row], violations: Sequence[Violation], *, units: int, seed: int,
            latency: float, thresholds: Sequence[float], processes: Sequence[int],
            work_stats: dict[str, float], runtime_s: float) -> dict[str, Any]:
    return {
        "units": units,
        "seed": seed,
        "latency": latency,
        "thresholds": list(thresholds),
        "processes": list(processes),
        "models": dict(MODEL_NAMES),
        "workload": work_stats,
        "rows": [row.to_json() for row in rows],
        "violations": [v.to_json() for v in violations],
        "verified": not violations,
        "runtime_s": runtime_s,
    }


def write_json(path: str | Path, obj: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def plot_path(target: str | Path, threshold: float) -> Path:
    """``--plot DIR`` gives ``DIR/sim-threshold-T.png``, ``--plot PREFIX`` gives
    ``PREFIX-threshold-T.png``."""
    target = Path(target)
    name = f"threshold-{threshold:g}.png"
    if target.is_dir():
        return target / f"sim-{name}"
    return target.with_name(f"{target.name}-{name}")


def _count_tick(value: float, _position: float) -> str:
    n = round(value)
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return f"{value:g}"


def write_plot(threshold: float, rows: Sequence[Row], path: str | Path, *, units: int,
               latency: float) -> None:
    """Speed-up against processes, one line per model and the ideal line (as the
    thesis's Figs 6.1-6.3), log-log so the whole range is readable, and the
    efficiency (speed-up / processes) beside it, where the models' gaps show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    procs = [row.processes for row in rows]
    fig, (ax, eff_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax.plot(procs, procs, ":", color="gray", label="ideal (linear)")
    eff_ax.axhline(1.0, linestyle=":", color="gray", label="ideal")
    for m, style in (("pm", "o-"), ("md", "s--"), ("mp", "^-.")):
        label = f"{MODEL_NAMES[m]} ({LABELS[m]})"
        ax.plot(procs, [row.speedup[m] for row in rows], style, label=label, markersize=4)
        eff_ax.plot(procs, [row.speedup[m] / row.processes for row in rows], style,
                    label=label, markersize=4)
    for a in (ax, eff_ax):
        a.set_xscale("log", base=2)
        a.xaxis.set_major_formatter(FuncFormatter(_count_tick))
        a.set_xlabel("processes")
        a.grid(True, which="both", alpha=0.3)
        a.legend(loc="best", fontsize="small")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(_count_tick))
    ax.set_ylabel("speed-up")
    ax.set_title("speed-up")
    eff_ax.set_ylabel("efficiency (speed-up / processes)")
    eff_ax.set_title("efficiency")
    fig.suptitle(f"mate.sim: threshold {threshold:g}, {units} work units, latency {latency:g}")
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
