"""The run report: one self-contained HTML page (plots inlined as PNG data URIs).

Sections (each an `<h2 id=...>`, SECTION_IDS): a plain-language privacy statement from
the ledger, the outcome (pushed or not, and why), privacy (the accounting as a table,
the ledger over rounds, epsilon vs users per round for larger populations), utility
(recall with intervals and ROC of the candidate, the last blessed model and the
pretrained start on held-out identities, recall during training on validation
identities), data (dedup and schedule statistics, with units). Metrics on training users
are never shown (docs/design.md section 5).
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline import privacy_text
from tff_algorithms.config import model_config

# Populations the ledger's schedule is extrapolated to (paper Fig. 2c/2d).
EXTRAPOLATION_POPULATIONS = (10**5, 10**6, 10**7)
# The page's sections, in order (ids of their <h2>; the browser test checks each).
SECTION_IDS = ("guarantee", "outcome", "privacy", "utility", "training", "data")


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
    axes.set_xlim(left=0)
    axes.set_xlabel("round (0 = the start, before private training)")
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
    axes.set_ylabel(f"epsilon spent (delta = {ledger['spec']['delta']:g})")
    axes.grid(True, alpha=0.3)
    axes.legend()
    axes.set_title("Privacy ledger")
    return _png(figure)


def extrapolation_plot(ledger: Mapping[str, Any]) -> str:
    """epsilon vs users per round at larger populations, by the library's extrapolation."""
    from tff_algorithms.privacy import accounting_spec, calibration

    base = accounting_spec.AccountingSpec.from_dict(ledger["spec"])
    curves = {}
    for population in (base.population, *EXTRAPOLATION_POPULATIONS):
        if population < base.population:
            continue
        users = [
            m for m in (base.users_per_round * 2**i for i in range(12)) if m <= population // 2
        ] or [base.users_per_round]
        points = calibration.extrapolate_privacy(base, population, users)
        # Epsilon underflows to 0 once the scaled noise is huge; a log axis cannot show 0.
        positive = [p for p in points if p.epsilon > 0]
        if positive:
            curves[f"{population:,} users"] = positive
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "extrapolation.png")
        calibration.write_extrapolation_plot(
            curves,
            path,
            title=f"{base.rounds} rounds, z scaled with users per round",
        )
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode()


def _table(rows: Sequence[tuple[Any, ...]], header: Sequence[str] | None = None) -> str:
    """Rows whose first cell is a label (<th>); `header` names the columns."""
    head = (
        "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead>"
        if header
        else ""
    )
    cells = "".join(
        f"<tr><th>{html.escape(str(row[0]))}</th>"
        + "".join(f"<td>{html.escape(str(v))}</td>" for v in row[1:])
        + "</tr>"
        for row in rows
    )
    return f"<table>{head}<tbody>{cells}</tbody></table>"


def _image(data: str, alt: str, caption: str = "") -> str:
    image = f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
    if not caption:
        return image
    return f"<figure>{image}<figcaption>{html.escape(caption)}</figcaption></figure>"


def _section(section_id: str, title: str) -> str:
    return f'<h2 id="{section_id}">{html.escape(title)}</h2>'


def _by_far(values: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return sorted(values.items(), key=lambda kv: -float(kv[0]))


def _recall_rows(label: str, result: Mapping[str, Any] | None) -> list[tuple[str, str, str]]:
    if not result:
        return []
    intervals = result.get("recall_at_far_interval", {})
    return [
        (
            f"{label} recall@FAR={far}",
            f"{value:.4f}",
            f"[{intervals[far][0]:.4f}, {intervals[far][1]:.4f}]" if far in intervals else "",
        )
        for far, value in _by_far(result["recall_at_far"])
    ]


def _gain_rows(evaluation: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    labels = {"pretrained": "over the pretrained start", "baseline": "over the last blessed"}
    return [
        (
            f"gain {labels.get(other, other)} at FAR={far}",
            f"{gain['difference']:+.4f}",
            f"[{gain['interval'][0]:+.4f}, {gain['interval'][1]:+.4f}]",
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


def _test_split_note(model: Mapping[str, Any]) -> str:
    counts = [
        f"{model[key]:,} {name}"
        for key, name in (
            ("identities", "identities"),
            ("images", "images"),
            ("genuine_pairs", "genuine pairs"),
            ("impostor_pairs", "impostor pairs"),
        )
        if isinstance(model.get(key), int)
    ]
    if not counts:
        return ""
    return (
        "<p>Recall (true accept rate) at a false accept rate (FAR): the share of genuine "
        "pairs accepted at the threshold that accepts that share of impostor pairs, on the "
        f"test split's held-out identities ({', '.join(counts)}).</p>"
    )


def _convention_text(spec: Mapping[str, Any]) -> str:
    return privacy_text.convention_text(spec)


def training_history(training_metrics: Mapping[str, Any]) -> tuple[list[dict], str]:
    """Evaluations during training, and a note saying where the curve starts."""
    history = [dict(e) for e in training_metrics.get("history", []) if "eval" in e]
    if any(e["round"] == 0 for e in history):
        return history, "Round 0 is the start: the backbone private training began from."
    first = f"round {history[0]['round']}" if history else "the end"
    return history, (
        "The training history records no evaluation at round 0 (the start), so the curve "
        f"begins at {first}; the pretrained start's recall on the test split is in the "
        "utility table."
    )


def eer_note(training_metrics: Mapping[str, Any]) -> str:
    """FDML's authentication accuracy at the EER threshold (its paper's Alg. 4) after the
    last round, as training recorded it (metrics.json `eer_accuracy`); "" without it."""
    result = training_metrics.get("eer_accuracy")
    if not result or result.get("accuracy") is None:
        return ""
    split = result["split"]
    protocol = (
        "the paper's split"
        if result["paper_split"]
        else f"a smaller split than the paper's 20/10/10 ({split['template']}/"
        f"{split['threshold']}/{split['test']} images for template/threshold/test)"
    )
    return (
        f"Authentication accuracy at the equal-error-rate threshold (FDML paper, Alg. 4) "
        f"after the last round, on {result['evaluated_users']} validation identities with "
        f"{result['reference_users']} reference users each, {protocol}: "
        f"{result['accuracy']:.4f} (balanced {result['balanced_accuracy']:.4f})."
    )


def _history_rows(history: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[tuple]]:
    fars = sorted({far for e in history for far in e["eval"]["recall_at_far"]}, key=float)
    fars.reverse()
    header = ["round"] + [f"recall@FAR={far}" for far in fars] + ["ε spent"]
    rows = []
    for entry in history:
        epsilon = entry.get("epsilon")
        rows.append(
            (
                f"{entry['round']}" + (" (start)" if entry["round"] == 0 else ""),
                *(
                    f"{entry['eval']['recall_at_far'][far]:.4f}"
                    if far in entry["eval"]["recall_at_far"]
                    else ""
                    for far in fars
                ),
                "∞" if epsilon is None else f"{epsilon:.3f}",
            )
        )
    return header, rows


def extrapolation_caption(ledger: Mapping[str, Any]) -> str:
    spec = ledger["spec"]
    k = int(spec.get("users_per_virtual_client", 1))
    return (
        "ε after the same training at larger populations: each line is a population of N "
        "users, the x axis the users per round M, the y axis ε. Held fixed: "
        f"{int(spec['rounds'])} rounds, δ = {float(spec['delta']):g}, {k} users per virtual "
        "client, the relation, accountant and convention of this run, and the noise on the "
        f"averaged update: the noise multiplier grows with M (z = {float(spec['noise_multiplier']):.3g}"
        f" × M / {int(spec['users_per_round']):,}), so by the paper's extrapolation "
        "hypothesis the model's utility stays what this run measured (the product's "
        "population benchmark found it held from 10^3 to 10^5 users in its configuration: "
        "BENCHMARKS.md). "
        "This run: N = "
        f"{int(spec['population']):,}, M = {int(spec['users_per_round']):,}, ε = "
        f"{privacy_text.format_epsilon(privacy_text.final_epsilon(ledger))}."
    )


def _model_rows(training_metrics: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The backbone as trained: architecture, input, embedding, normalisation."""
    config = training_metrics.get("config") or {}
    if "architecture" not in config:
        return []
    return [
        ("architecture", str(config["architecture"])),
        (
            "input",
            f"{config.get('image_size', '?')}×{config.get('image_size', '?')}×"
            f"{config.get('channels', '?')}",
        ),
        ("embedding size", str(config.get("embedding_size", "?"))),
        (
            "normalisation",
            model_config.normalisation_text(
                config["architecture"], config.get("batch_norm", model_config.BATCH_NORM_AUTO)
            ),
        ),
    ]


def _dedup_rows(dedup: Mapping[str, Any]) -> list[tuple]:
    rows = []
    for name, part in sorted(dedup.items()):
        candidates = part["candidate_records"]
        removed = part["removed_exact"] + part["removed_near"]
        share = removed / candidates if candidates else 0.0
        limit = part.get("max_removed_fraction")
        rows.append(
            (
                f"{part.get('candidate_split', name)} images against "
                f"{part.get('reference_splits', 'the reference splits')}",
                f"{candidates:,} images",
                f"{part['removed_exact']:,} images",
                f"{part['removed_near']:,} images",
                f"{share:.2%}" + (f" (stop above {limit:.0%})" if limit is not None else ""),
            )
        )
    return rows


def render_report(
    evaluation: Mapping[str, Any],
    ledger: Mapping[str, Any],
    training_metrics: Mapping[str, Any],
    schedule: Mapping[str, Any],
    dedup: Mapping[str, Any],
    pushed_to: str | None,
    model_card: str | None = None,
    composition: Mapping[str, Any] | None = None,
) -> str:
    """The HTML page of a run, from the JSON files its artifacts hold.

    `model_card`: a link (relative or absolute) to the pushed model's card, if any.
    `composition`: the model's private runs, whose composed epsilon is the model's.
    """
    budget = evaluation["privacy_budget_epsilon"]
    curves = {"trained (private)": evaluation["model"]["roc"]}
    if "baseline" in evaluation and evaluation["baseline"]["id"] != evaluation["model"]["id"]:
        curves["last blessed"] = evaluation["baseline"]["roc"]
    if "pretrained" in evaluation:
        private_start = composition is not None and len(composition["runs"]) > 1
        label = "pretrained (private, Logit-DP)" if private_start else "pretrained (public)"
        curves[label] = evaluation["pretrained"]["roc"]
    outcome = (
        f"Pushed to {pushed_to}"
        if pushed_to
        else "Not pushed: " + "; ".join(evaluation["not_blessed_because"] or ["not blessed"])
    )
    card_link = (
        f'<p>Model card: <a href="{html.escape(model_card)}">{html.escape(model_card)}</a></p>'
        if model_card
        else ""
    )
    history, history_note = training_history(training_metrics)
    split_mode = evaluation.get("split_mode")
    evaluation_inputs = bool(evaluation.get("evaluation_inputs"))
    protocol_text = split_mode and privacy_text.split_protocol_text(split_mode, evaluation_inputs)
    protocol = f'<p class="protocol">{html.escape(protocol_text)}</p>' if split_mode else ""
    sections = [
        "<h1>dp-fedemb run report</h1>",
        _section("guarantee", "What the privacy guarantee means"),
        f'<p class="statement">{html.escape(privacy_text.privacy_statement(ledger, composition, split_mode, evaluation_inputs))}</p>',
        protocol,
        _section("outcome", "Outcome"),
        f'<p class="outcome">{html.escape(outcome)}</p>',
        card_link,
        _section("privacy", "Privacy accounting"),
        _table(
            privacy_text.accounting_rows(ledger, composition)
            + [
                ("ε checked by the evaluator", f"{evaluation['epsilon']:.4g}"),
                ("privacy budget (ε)", f"{budget:g}"),
            ],
            header=("quantity", "value"),
        ),
        _image(
            ledger_plot(ledger, budget),
            "privacy ledger over rounds",
            "ε spent after each round (composed over rounds by the accountant above), and "
            "the budget the evaluator enforces.",
        ),
        _image(
            extrapolation_plot(ledger), "epsilon vs users per round", extrapolation_caption(ledger)
        ),
        _section("utility", "Utility on held-out identities"),
        _test_split_note(evaluation["model"]),
        _table(
            _recall_rows("trained", evaluation["model"])
            + _recall_rows("pretrained", evaluation.get("pretrained"))
            + _recall_rows("last blessed", evaluation.get("baseline"))
            + _gain_rows(evaluation),
            header=("measure", "value", "interval [low, high]"),
        ),
        _bootstrap_note(evaluation.get("bootstrap")),
        _image(roc_plot(curves), "ROC", "ROC on the test split's held-out identities."),
        _section("training", "Recall during training (validation identities)"),
        f"<p>{html.escape(history_note)}</p>",
    ]
    if eer_note(training_metrics):
        sections.append(f"<p>{html.escape(eer_note(training_metrics))}</p>")
    if history:
        header, rows = _history_rows(history)
        sections += [
            _image(
                recall_history_plot(history),
                "recall during training",
                "Recall at each evaluation during private training, on validation "
                "identities (held out from training, not the test split).",
            ),
            _table(rows, header=header),
        ]
    if _model_rows(training_metrics):
        sections += [
            _section("model", "Model"),
            _table(_model_rows(training_metrics), header=("quantity", "value")),
        ]
    sections += [
        _section("data", "Data"),
        "<h3>Training schedule</h3>",
        _table(privacy_text.schedule_rows(schedule), header=("quantity", "value")),
        "<h3>Deduplication (near and exact copies removed before training)</h3>",
        _table(
            _dedup_rows(dedup),
            header=("check", "candidates", "removed exact", "removed near", "removed share"),
        ),
    ]
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;"
        "padding:.3em .6em;text-align:left}thead th{background:#eee}img{display:block;"
        "margin:1em 0}figure{margin:1em 0}figcaption{font-size:.9em;color:#444;max-width:50em}"
        ".outcome{font-size:1.2em;font-weight:bold}"
        ".statement{font-size:1.1em;background:#f3f6fb;border-left:4px solid #4a6fa5;"
        "padding:.6em 1em}"
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>dp-fedemb report</title>"
        f"<style>{style}</style></head><body>{''.join(sections)}</body></html>"
    )
