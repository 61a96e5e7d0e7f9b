"""What `pagoda tune` leaves behind: a table of every trial, the recommended `pagoda serve`
command line, goodput (and p99 TTFT) before and after, results.json and a PNG of latency
against throughput per trial."""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from pagoda.bench.load import plot_latency_vs_throughput
from pagoda.tune.runner import Trial
from pagoda.tune.server import knob_flags


def serve_command(model: str | None, knobs: dict[str, Any]) -> str:
    knobs = dict(knobs)
    model = knobs.pop("model", model)
    words = ["pagoda", "serve", *([model] if model else []), *knob_flags(knobs)]
    return shlex.join(words)


def _at(trial: Trial, which: str) -> dict[str, Any]:
    """The trial's run at its lowest rate ("low") or the one with the best goodput ("best")."""
    if which == "low":
        return min(trial.runs, key=lambda m: m["rate"])
    return max(trial.runs, key=lambda m: m["request_goodput"] or 0.0)


def table(trials: list[Trial]) -> str:
    head = ("| # | trial | kept | goodput req/s (best rate) | output tok/s (rate inf) | "
            "p99 TTFT ms (50% load) | median TPOT ms (50% load) | note |")  # fmt: skip
    rows = [head, "|" + "---|" * 8]
    for i, t in enumerate(trials):
        if not t.runs:
            rows.append(f"| {i} | {t.name} | | | | | | {t.note} |")
            continue
        low, best = _at(t, "low"), _at(t, "best")
        inf = max(t.runs, key=lambda m: m["rate"])
        rows.append(
            f"| {i} | {t.name} | {'yes' if t.kept else ''} | {best['request_goodput']:.2f} | "
            f"{inf['output_throughput']:.0f} | {low['p99_ttft_ms']:.0f} | "
            f"{low['median_tpot_ms']:.1f} | {t.note} |"
        )
    return "\n".join(rows)


def write_report(
    out_dir: str, goal: str, model: str | None, settings: dict[str, Any], trials: list[Trial],
    base: Trial, best: Trial, base_again: Trial | None, best_again: Trial | None,
) -> str:  # fmt: skip
    """Writes report.md, results.json and latency_vs_throughput.png; returns the report."""
    from pagoda.tune.runner import better

    before, after = (base_again, best_again) if best_again is not None else (base, best)
    held = best is base or (after.score is not None and before.score is not None
                            and better(goal, after.score, before.score))  # fmt: skip
    recommended = best if held else base
    lines = [
        f"# pagoda tune --goal {goal}",
        "",
        "Settings: " + ", ".join(f"{k} {v}" for k, v in settings.items()),
        "",
        table(trials),
        "",
        "Recommended:",
        "",
        "    " + serve_command(model, recommended.knobs),
        "",
    ]
    after_label = "after (recommended)" if held else f"after ({best.name}, not kept)"
    for label, t in (("before (defaults)", before), (after_label, after)):
        if t.runs:
            lines.append(f"- {label}: goodput {_at(t, 'best')['request_goodput']:.2f} req/s, "
                         f"p99 TTFT at 50% load {_at(t, 'low')['p99_ttft_ms']:.0f} ms, output "
                         f"{max(t.runs, key=lambda m: m['rate'])['output_throughput']:.0f} "
                         "tok/s at rate inf")  # fmt: skip
    if best_again is not None and (best_again.score is None or base_again.score is None):
        lines.append(f"- {best.name} was not measured again (time budget): the defaults stay")
    elif best_again is not None:
        lines.append("- before and after measured again one after the other at the end"
                     + ("" if held else "; the change did not hold, so the defaults stay"))  # fmt: skip
    elif best is base:
        lines.append("- no change helped by more than 5%: the defaults stay")
    series = {f"{i} {t.name}": t.runs for i, t in enumerate(trials) if t.runs}
    png = plot_latency_vs_throughput(series, os.path.join(out_dir, "latency_vs_throughput.png"),
                                     f"pagoda tune --goal {goal}")  # fmt: skip
    lines += ["", "![latency vs throughput](latency_vs_throughput.png)" if png
              else "(no plot: pip install matplotlib, or 'pagoda[plot]')"]  # fmt: skip
    report = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(report)
    results = {
        "goal": goal, "settings": settings, "recommended": serve_command(model, recommended.knobs),
        "trials": [{"name": t.name, "knobs": t.knobs, "kept": t.kept, "score": t.score,
                    "note": t.note, "seconds": t.seconds, "runs": t.runs,
                    "load_avg_1m_after_each_run": t.load_avg} for t in trials],
    }  # fmt: skip
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)
    return report
