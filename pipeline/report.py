"""The run report: one self-contained HTML page (plots inlined as PNG data URIs).

Sections: outcome (pushed or not, and why), privacy (epsilon, delta, ledger over rounds,
epsilon vs users per round for larger populations), utility (ROC of the candidate, the
last blessed model and the pretrained starting point on held-out identities, recall
during training on validation identities), data (dedup and schedule statistics).
Metrics on training users are never shown (DESIGN.md section 5).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

# Populations the ledger's schedule is extrapolated to (paper Fig. 2c/2d).
EXTRAPOLATION_POPULATIONS = (10**5, 10**6, 10**7)


def _figure():
    # The object-oriented API with the Agg canvas leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _png(figure) -> str:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode()


def roc_plot(curves: Mapping[str, Mapping[str, Sequence[float]]]) -> str:
    figure = _figure()
    axes = figure.add_subplot()
    for label, roc in curves.items():
        axes.plot(roc["far"], roc["recall"], label=label)
    axes.set_xscale("log")
    axes.set_xlabel("false accept rate")
    axes.set_ylabel("recall (true accept rate)")
    axes.set_ylim(0, 1)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    axes.set_title("ROC on held-out identities (test split)")
    return _png(figure)


def recall_history_plot(history: Sequence[Mapping[str, Any]]) -> str:
    figure = _figure()
    axes = figure.add_subplot()
    fars = sorted({far for entry in history for far in entry["eval"]["recall_at_far"]}, key=float)
    for far in fars:
        points = [(e["round"], e["eval"]["recall_at_far"][far]) for e in history]
        axes.plot(*zip(*points), marker="o", label=f"FAR {far}")
    axes.set_xlabel("round")
    axes.set_ylabel("recall")
    axes.set_ylim(0, 1)
    axes.grid(True, alpha=0.3)
    axes.legend()
    axes.set_title("Recall during training (validation identities)")
    return _png(figure)


def ledger_plot(ledger: Mapping[str, Any], budget: float) -> str:
    history = ledger["history"]
    figure = _figure()
    axes = figure.add_subplot()
    rounds = [0] + [entry["round"] for entry in history]
    epsilons = [0.0] + [
        math.inf if entry["epsilon"] is None else entry["epsilon"] for entry in history
    ]
    axes.plot(rounds, epsilons, marker=".", label="epsilon spent")
    axes.axhline(budget, color="red", linestyle="--", label=f"budget {budget:g}")
    axes.set_xlabel("round")
    axes.set_ylabel(f"epsilon (delta = {ledger['spec']['delta']:g})")
    axes.grid(True, alpha=0.3)
    axes.legend()
    axes.set_title("Privacy ledger")
    return _png(figure)


def extrapolation_plot(ledger: Mapping[str, Any]) -> str:
    """epsilon vs users per round at larger populations, by the library's extrapolation."""
    from tff_algorithms import accounting

    base = accounting.AccountingSpec.from_dict(ledger["spec"])
    curves = {}
    for population in (base.population, *EXTRAPOLATION_POPULATIONS):
        if population < base.population:
            continue
        users = [
            m for m in (base.users_per_round * 2**i for i in range(12)) if m <= population // 2
        ] or [base.users_per_round]
        points = accounting.extrapolate_privacy(base, population, users)
        # Epsilon underflows to 0 once the scaled noise is huge; a log axis cannot show 0.
        positive = [p for p in points if p.epsilon > 0]
        if positive:
            curves[f"{population:,} users"] = positive
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "extrapolation.png")
        accounting.write_extrapolation_plot(
            curves,
            path,
            title=f"{base.rounds} rounds, z scaled with users per round",
        )
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode()


def _table(rows: Sequence[tuple[str, Any]]) -> str:
    cells = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows
    )
    return f"<table>{cells}</table>"


def _image(data: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _by_far(values: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return sorted(values.items(), key=lambda kv: -float(kv[0]))


def _recall_rows(label: str, result: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    if not result:
        return []
    intervals = result.get("recall_at_far_interval", {})
    return [
        (
            f"{label} recall@FAR={far}",
            f"{value:.4f}"
            + (f" [{intervals[far][0]:.4f}, {intervals[far][1]:.4f}]" if far in intervals else ""),
        )
        for far, value in _by_far(result["recall_at_far"])
    ]


def _gain_rows(evaluation: Mapping[str, Any]) -> list[tuple[str, Any]]:
    labels = {"pretrained": "over the pretrained start", "baseline": "over the last blessed"}
    return [
        (
            f"gain {labels.get(other, other)} at FAR={far}",
            f"{gain['difference']:+.4f} [{gain['interval'][0]:+.4f}, {gain['interval'][1]:+.4f}]",
        )
        for other, gains in evaluation["model"].get("versus", {}).items()
        for far, gain in _by_far(gains)
    ]


def _bootstrap_note(bootstrap: Mapping[str, Any] | None) -> str:
    if not bootstrap:
        return ""
    return (
        f"<p>[low, high]: {bootstrap['confidence']:.0%} bootstrap intervals over "
        f"{bootstrap['resamples']} resamples of the held-out identities; a gain's interval is "
        "paired (both models scored on each resample).</p>"
    )


def _convention_text(spec: Mapping[str, Any]) -> str:
    from tff_algorithms import accounting

    sensitivity = accounting.AccountingSpec.from_dict(spec).sensitivity_in_clips
    return f"{spec['convention']} (L2 sensitivity {sensitivity:g} x clip norm)"


def render_report(
    evaluation: Mapping[str, Any],
    ledger: Mapping[str, Any],
    training_metrics: Mapping[str, Any],
    schedule: Mapping[str, Any],
    dedup: Mapping[str, Any],
    pushed_to: str | None,
) -> str:
    """The HTML page of a run, from the JSON files its artifacts hold."""
    budget = evaluation["privacy_budget_epsilon"]
    curves = {"trained (private)": evaluation["model"]["roc"]}
    if "baseline" in evaluation and evaluation["baseline"]["id"] != evaluation["model"]["id"]:
        curves["last blessed"] = evaluation["baseline"]["roc"]
    if "pretrained" in evaluation:
        curves["pretrained (public)"] = evaluation["pretrained"]["roc"]
    outcome = (
        f"Pushed to {pushed_to}"
        if pushed_to
        else "Not pushed: " + "; ".join(evaluation["not_blessed_because"] or ["not blessed"])
    )
    sections = [
        "<h1>dp-fedemb run report</h1>",
        f'<p class="outcome">{html.escape(outcome)}</p>',
        "<h2>Privacy</h2>",
        _table(
            [
                ("epsilon", f"{evaluation['epsilon']:.4g}"),
                ("delta", f"{evaluation['delta']:g}"),
                ("budget", f"{budget:g}"),
                ("accounting convention", _convention_text(ledger["spec"])),
                ("neighbouring relation", ledger["spec"]["neighboring_relation"]),
                ("accounting", json.dumps(ledger["spec"], sort_keys=True)),
            ]
        ),
        _image(ledger_plot(ledger, budget), "privacy ledger over rounds"),
        _image(extrapolation_plot(ledger), "epsilon vs users per round"),
        "<h2>Utility on held-out identities</h2>",
        _table(
            _recall_rows("trained", evaluation["model"])
            + _recall_rows("pretrained", evaluation.get("pretrained"))
            + _recall_rows("last blessed", evaluation.get("baseline"))
            + _gain_rows(evaluation)
        ),
        _bootstrap_note(evaluation.get("bootstrap")),
        _image(roc_plot(curves), "ROC"),
    ]
    history = [e for e in training_metrics["history"] if "eval" in e]
    if history:
        sections.append(_image(recall_history_plot(history), "recall during training"))
    sections += [
        "<h2>Data</h2>",
        _table(sorted(schedule.items())),
        _table(
            [
                (
                    name,
                    f"removed {part['removed_exact']} exact, {part['removed_near']} near "
                    f"of {part['candidate_records']}",
                )
                for name, part in sorted(dedup.items())
            ]
        ),
    ]
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;"
        "padding:.3em .6em;text-align:left}img{display:block;margin:1em 0}"
        ".outcome{font-size:1.2em;font-weight:bold}"
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>dp-fedemb report</title>"
        f"<style>{style}</style></head><body>{''.join(sections)}</body></html>"
    )
