"""The three work-stealing models of thesis §3.4/§4.2, measured on this machine.

Runs examples/work_stealing.py under mate-run (MPI, 2 ranks) for each model,
`--repeat` times each, interleaved (model A, B, C, A, B, C, ...) so that the
machine's drift hits every model alike, without and with injected faults.
Writes bench/results/work-stealing.json (every run) and .txt (medians), and a
PNG of the speed-ups.

    python bench/work_stealing.py [--repeat 5] [--queens 13]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODELS = ("progressive", "driven", "passing")
FAULTS = "drop=0.02,delay=0.02:0.3,fail=0.02"


def run(model: str, queens: int, faults: str | None) -> dict[str, object]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [str(Path(sys.executable).with_name("mate-run")), "-n", "2", sys.executable,
                   str(ROOT / "examples" / "work_stealing.py"), "--transport", "mpi",
                   "--model", model, "-n", str(queens), "--json", out.name]
        if faults:
            command += ["--faults", faults]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
        figures: dict[str, object] = json.loads(Path(out.name).read_text())
    print(f"{model:>11} faults={faults or '-':<34} speed-up {figures['speedup']:.2f} "
          f"({figures['elapsed_s']:.3f} s vs {figures['sequential_s']:.3f} s)", flush=True)
    return figures


def capacity(queens: int) -> float:
    """What 2 ranks could gain here now: 2 x (one count alone) / (two counts at once).

    The cores of a shared VM do not always run two processes at full speed;
    this bounds the speed-up any model can show in the same minute.
    """
    count = ("import sys, time; sys.path.insert(0, sys.argv[1]); import work_stealing as w; "
             "t = time.perf_counter(); n = int(sys.argv[2]); "
             "sum(w.solve(n, 3, *u[1:]) for u in w.units_of(n, 3)); "
             "print(time.perf_counter() - t)")
    command = [sys.executable, "-c", count, str(ROOT / "examples"), str(queens)]
    alone = float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    pair = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    together = statistics.mean(float(p.communicate()[0]) for p in pair)
    print(f"   capacity {2 * alone / together:.2f} ({alone:.3f} s alone, {together:.3f} s "
          f"two at once)", flush=True)
    return 2 * alone / together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--queens", type=int, default=13)
    args = parser.parse_args()
    runs, capacities = [], []
    for faults in (None, FAULTS):
        for _ in range(args.repeat):
            capacities.append(capacity(args.queens))
            for model in MODELS:
                runs.append(run(model, args.queens, faults))
    lines = [f"# examples/work_stealing.py, {args.queens}-queens, MPI, 2 ranks on this 2-core "
             f"VM; medians of {args.repeat} interleaved runs",
             f"{'model':>11} {'faults':>6} {'speed-up':>8} {'elapsed s':>9} {'one rank s':>10} "
             f"{'steals':>6} {'answer ms':>9}"]
    table = []
    for faults in (None, FAULTS):
        for model in MODELS:
            mine = [r for r in runs if r["model"] == model and r["faults"] == faults]
            assert all(r["verified"] for r in mine)
            row = {"model": model, "faults": faults, "runs": len(mine)}
            for key in ("speedup", "elapsed_s", "sequential_s", "steals",
                        "answer_latency_median_ms"):
                values = [r[key] for r in mine if r[key] is not None]
                row[key] = statistics.median(values) if values else None  # type: ignore[type-var]
            table.append(row)
            answer = row["answer_latency_median_ms"]
            lines.append(f"{model:>11} {'yes' if faults else 'no':>6} {row['speedup']:>8.2f} "
                         f"{row['elapsed_s']:>9.3f} {row['sequential_s']:>10.3f} "
                         f"{row['steals']:>6.0f} {answer if answer is None else f'{answer:9.3f}'}")
    lines.append(f"# faults: {FAULTS}")
    lines.append(f"# capacity of the machine for 2 processes (2 x one count alone / two at "
                 f"once), median of {len(capacities)}: {statistics.median(capacities):.2f} "
                 f"(range {min(capacities):.2f}-{max(capacities):.2f})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "work-stealing.json").write_text(json.dumps(
        {"medians": table, "runs": runs, "capacity": capacities}, indent=1))
    (RESULTS / "work-stealing.txt").write_text("\n".join(lines) + "\n")
    plot(table, args.queens, RESULTS / "work-stealing.png")
    print("\n".join(lines))


def plot(table: list[dict[str, object]], queens: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for offset, faults, label in ((-width / 2, None, "no faults"),
                                  (width / 2, FAULTS, f"faults {FAULTS}")):
        values = [next(r["speedup"] for r in table if r["model"] == m and r["faults"] == faults)
                  for m in MODELS]
        ax.bar([i + offset for i in range(len(MODELS))], values, width, label=label)
    ax.axhline(2, color="grey", linestyle="--", linewidth=1, label="ideal (2 ranks)")
    ax.set_xticks(range(len(MODELS)), MODELS)
    ax.set_ylabel("speed-up over one rank")
    ax.set_title(f"Work stealing, {queens}-queens, MPI, 2 ranks (medians)")
    ax.set_ylim(0, 2.7)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
