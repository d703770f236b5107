"""The model card of a trained model: model_card.json, model_card.md and model_card.html.

`model-card-toolkit` does not install with the locked stack (every release needs
jsonschema<4; Beam 2.59 pins jsonschema 4), so the card is built here with the field
names of the Model Card Toolkit JSON schema (schema_version 0.0.2: model_details,
model_parameters, quantitative_analysis, considerations), which MCT and other tools
read. The privacy guarantee is the report's plain-language statement, from the ledger,
followed, for a model trained with shared negatives (issue 22), by the report's row on
their DPLC releases: how many, of how many noisy cluster centers, and their ε alone
(`privacy_text.shared_negatives_rows`; the model's ε already includes them).
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping
from typing import Any

from pipeline import privacy_text
from tff_algorithms.config import model_config

SCHEMA_VERSION = "0.0.2"
JSON_FILE = "model_card.json"
MARKDOWN_FILE = "model_card.md"
HTML_FILE = "model_card.html"

INTENDED_USES = (
    "Embedding images for verification (are two images of the same identity?) and "
    "retrieval among identities of the kind it was trained on; pick the decision "
    "threshold from the recall at the false accept rate (FAR) your application accepts.",
)
USERS = (
    "Teams who need an identity embedding trained on user data under a user-level "
    "differential privacy guarantee.",
)
LIMITATIONS = (
    "Recall was measured on held-out identities of this dataset only; images from "
    "another population, camera or domain can score very differently.",
    "Recall at small FAR rests on few impostor pairs (the count is under utility), and "
    "its interval is over held-out identities for this one trained model: another noise "
    "draw moves it too.",
    "The guarantee is per user. An identity whose images many users hold (a landmark, "
    "a public figure) can still be learned: that is the model's purpose.",
    "Public pretraining data and evaluation users are not covered by the guarantee.",
    "Not for identifying people without their consent, or for decisions about people "
    "without human review.",
)


def _far_sorted(values: Mapping[str, Any]) -> list[str]:
    return sorted(values, key=lambda far: -float(far))


def performance_metrics(evaluation: Mapping[str, Any]) -> list[dict[str, Any]]:
    """MCT PerformanceMetric entries: recall@FAR with intervals, and gains over other models."""
    model = evaluation["model"]
    slice_name = (
        f"held-out identities ({model.get('identities', '?')} identities, "
        f"{model.get('images', '?')} images)"
    )
    intervals = model.get("recall_at_far_interval", {})
    metrics = []
    for far in _far_sorted(model["recall_at_far"]):
        entry: dict[str, Any] = {
            "type": f"recall at FAR {far}",
            "value": f"{model['recall_at_far'][far]:.4f}",
            "slice": slice_name,
        }
        if far in intervals:
            low, high = intervals[far]
            entry["confidence_interval"] = {
                "lower_bound": f"{low:.4f}",
                "upper_bound": f"{high:.4f}",
            }
        metrics.append(entry)
    names = {"pretrained": "the pretrained start", "baseline": "the last blessed model"}
    for other, gains in model.get("versus", {}).items():
        for far in _far_sorted(gains):
            gain = gains[far]
            metrics.append(
                {
                    "type": f"recall gain over {names.get(other, other)} at FAR {far}",
                    "value": f"{gain['difference']:+.4f}",
                    "slice": slice_name,
                    "confidence_interval": {
                        "lower_bound": f"{gain['interval'][0]:+.4f}",
                        "upper_bound": f"{gain['interval'][1]:+.4f}",
                    },
                }
            )
    return metrics


def privacy_guarantee(
    ledger: Mapping[str, Any],
    composition: Mapping[str, Any] | None = None,
    split_mode: str | None = None,
    evaluation_inputs: bool = False,
) -> str:
    """The card's privacy paragraph: the report's statement, then the shared-negatives
    releases the ledger accounted (nothing more for a ledger without them)."""
    releases = "".join(
        f" {label[0].upper()}{label[1:]}: {value}."
        for label, value in privacy_text.shared_negatives_rows(ledger)
    )
    statement = privacy_text.privacy_statement(ledger, composition, split_mode, evaluation_inputs)
    return statement + releases


def build_model_card(
    evaluation: Mapping[str, Any],
    ledger: Mapping[str, Any],
    training_metrics: Mapping[str, Any],
    schedule: Mapping[str, Any],
    pushed_to: str | None,
    version: str | None = None,
    composition: Mapping[str, Any] | None = None,
    serving_bounds: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The card as a dict in the Model Card Toolkit schema's field names; `composition`:
    the model's private runs (its epsilon is theirs composed); `serving_bounds`: the
    signature's pixel bounds an image and a call (`modeling.bounded_decode`), which a
    caller must know."""
    spec = ledger["spec"]
    split_mode = evaluation.get("split_mode")
    evaluation_inputs = bool(evaluation.get("evaluation_inputs"))
    statement = privacy_guarantee(ledger, composition, split_mode, evaluation_inputs)
    epsilon = privacy_text.model_epsilon(ledger, composition)
    model = evaluation["model"]
    bootstrap = evaluation.get("bootstrap") or {}
    algorithm = training_metrics.get("algorithm", "dp-fedemb")
    config = training_metrics.get("config") or {}
    architecture = config.get("architecture", "see the training config")
    if "embedding_size" in config:
        architecture += (
            f", {config['embedding_size']}-dimensional embedding, input "
            f"{config.get('image_size', '?')}×{config.get('image_size', '?')}×"
            f"{config.get('channels', '?')}"
        )
    if "architecture" in config:
        architecture += "; normalisation: " + model_config.normalisation_text(
            config["architecture"], config.get("batch_norm", model_config.BATCH_NORM_AUTO)
        )
    bounds = (
        f"; at most {serving_bounds[0]:,} pixels an image and {serving_bounds[1]:,} a call, "
        "checked from the headers before decoding (over them the call fails)"
        if serving_bounds
        else ""
    )
    intervals = (
        f" Intervals: {bootstrap['confidence']:.0%} bootstrap over {bootstrap['resamples']} "
        "resamples of the held-out identities; a gain's interval is paired."
        if bootstrap
        else ""
    )
    return {
        "schema_version": SCHEMA_VERSION,
        "model_details": {
            "name": f"dp-fedemb image embedding ({algorithm})",
            "overview": (
                f"Image embedding model trained with {algorithm} under user-level "
                f"differential privacy (ε = {privacy_text.format_epsilon(epsilon)}, "
                f"δ = {float(spec['delta']):g})."
            ),
            "documentation": (
                "Serving signature serving_default: input `images` (a batch of PNG or JPEG "
                "bytes), output `embedding` (unit-norm float32 vectors); compare two "
                f"embeddings by their dot product{bounds}. Privacy: " + statement
            ),
            "version": {"name": version or "", "diff": ""},
            "path": pushed_to or "",
            "references": [{"reference": "DP-FedEmb: user-level DP embeddings (paper)"}],
        },
        "model_parameters": {
            "model_architecture": f"{architecture}; no classification head is exported",
            "data": [
                {
                    "name": "private training users",
                    "description": (
                        f"{int(spec['population']):,} users' images, trained on for "
                        f"{int(spec['rounds'])} rounds of {int(spec['users_per_round']):,} "
                        "users; never published; protected by the privacy guarantee above."
                    ),
                    "sensitive": {"sensitive_data": ["user images (possibly faces)"]},
                },
                {
                    "name": "held-out evaluation identities",
                    "description": (
                        f"{model.get('identities', '?')} identities, {model.get('images', '?')} "
                        f"images, {model.get('genuine_pairs', '?')} genuine and "
                        f"{model.get('impostor_pairs', '?')} impostor pairs; identities and "
                        "users never in training; deduplicated against training." + intervals
                    ),
                },
            ],
            "input_format": "images: string[batch], PNG or JPEG bytes (decoded inside the "
            f"model){bounds}",
            "output_format": "embedding: float32[batch, embedding size], unit L2 norm",
        },
        "quantitative_analysis": {"performance_metrics": performance_metrics(evaluation)},
        "considerations": {
            "users": [{"description": text} for text in USERS],
            "use_cases": [{"description": text} for text in INTENDED_USES],
            "limitations": [{"description": text} for text in LIMITATIONS]
            + (
                [{"description": privacy_text.split_protocol_text(split_mode, evaluation_inputs)}]
                if split_mode
                else []
            ),
            "tradeoffs": [
                {
                    "description": (
                        "Privacy noise costs utility: a smaller ε, or fewer users, means "
                        "lower recall; more users per round at the same noise per user "
                        "buys both (the report's ε-vs-users plot)."
                    )
                }
            ],
            "ethical_considerations": [
                {
                    "name": "Privacy of the users whose images trained the model",
                    "mitigation_strategy": statement,
                }
            ],
        },
    }


def _metric_line(metric: Mapping[str, Any]) -> tuple[str, str, str]:
    interval = metric.get("confidence_interval")
    bounds = f"[{interval['lower_bound']}, {interval['upper_bound']}]" if interval else ""
    return metric["type"], metric["value"], bounds


def render_markdown(card: Mapping[str, Any]) -> str:
    details, params = card["model_details"], card["model_parameters"]
    considerations = card["considerations"]
    lines = [f"# Model card: {details['name']}", "", details["overview"], ""]
    lines += [
        "## Privacy guarantee",
        "",
        considerations["ethical_considerations"][0]["mitigation_strategy"],
        "",
    ]
    lines += ["## Intended use", ""] + [
        f"- {u['description']}" for u in considerations["use_cases"]
    ]
    lines += ["", "## Data", ""] + [
        f"- **{d['name']}**: {d['description']}" for d in params["data"]
    ]
    lines += ["", "## Utility", ""]
    lines += [f"On {params['data'][-1]['description']}", ""]
    lines += ["| metric | value | interval |", "|---|---|---|"]
    lines += [
        "| {} | {} | {} |".format(*_metric_line(m))
        for m in card["quantitative_analysis"]["performance_metrics"]
    ]
    lines += ["", "## Limits", ""] + [
        f"- {item['description']}" for item in considerations["limitations"]
    ]
    lines += ["", "## Serving", "", details["documentation"].split(" Privacy: ")[0], ""]
    return "\n".join(lines)


def render_html(card: Mapping[str, Any]) -> str:
    details, params = card["model_details"], card["model_parameters"]
    considerations = card["considerations"]

    def items(entries: list[str]) -> str:
        return "<ul>" + "".join(f"<li>{html.escape(e)}</li>" for e in entries) + "</ul>"

    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _metric_line(m)) + "</tr>"
        for m in card["quantitative_analysis"]["performance_metrics"]
    )
    body = [
        f"<h1>Model card: {html.escape(details['name'])}</h1>",
        f"<p>{html.escape(details['overview'])}</p>",
        '<h2 id="privacy">Privacy guarantee</h2>',
        f"<p class='statement'>{html.escape(considerations['ethical_considerations'][0]['mitigation_strategy'])}</p>",
        '<h2 id="intended-use">Intended use</h2>',
        items([u["description"] for u in considerations["use_cases"]]),
        '<h2 id="data">Data</h2>',
        items([f"{d['name']}: {d['description']}" for d in params["data"]]),
        '<h2 id="utility">Utility</h2>',
        f"<p>On {html.escape(params['data'][-1]['description'])}</p>",
        f"<table><tr><th>metric</th><th>value</th><th>interval</th></tr>{rows}</table>",
        '<h2 id="limits">Limits</h2>',
        items([item["description"] for item in considerations["limitations"]]),
    ]
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}"
        "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:.3em .6em}"
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>model card</title>"
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>"
    )


def write_model_card(card: Mapping[str, Any], directory: str) -> list[str]:
    """Writes the JSON, Markdown and HTML card into `directory`; returns the paths."""
    import tensorflow as tf

    paths = []
    for name, text in (
        (JSON_FILE, json.dumps(card, indent=2, sort_keys=True, allow_nan=False)),
        (MARKDOWN_FILE, render_markdown(card)),
        (HTML_FILE, render_html(card)),
    ):
        path = os.path.join(directory, name)
        with tf.io.gfile.GFile(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths
