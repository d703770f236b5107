"""EvaluateAndBless: exact recall@FAR on held-out identities, ROC, and the blessing gates.

Every recall comes with a bootstrap interval over held-out identities, and the
candidate's difference from the pretrained start and the last blessed model with a
paired one (both models scored on each resample).

A model is blessed only if
- its privacy ledger's epsilon was accounted under the strict convention
  (tff_algorithms.privacy.accounting), is finite and within the configured budget (a model over
  budget is never blessed, whatever its recall), and
- its recall at the gate FAR is no worse (up to `max_recall_regression`) than that of
  the last blessed model, which the standard LatestBlessedModelStrategy resolver gives,
  and
- its recall at the gate FAR is not significantly below that of the pretrained start it
  trained from (the paired interval of the difference lies wholly below zero): spending
  privacy budget for a worse model than the start is never pushed, even as a first
  model, when no last blessed model guards it.
The blessing follows the TFX Evaluator contract the standard Pusher checks: custom
properties `blessed`, `current_model`, `current_model_id`, and a BLESSED or NOT_BLESSED
file.
"""

import json
import math
import os

import tensorflow as tf
from tfx import types
from tfx.dsl.component.experimental.annotations import InputArtifact, OutputArtifact, Parameter
from tfx.dsl.component.experimental.decorators import component
from tfx.types import standard_artifacts

from pipeline.components import artifacts, layout
from tff_algorithms.privacy import accounting_spec

EVALUATION_FILE = "evaluation.json"


def _comparison(
    model_dirs: dict[str, str],
    records_dir: str,
    num_resamples: int,
    confidence: float,
    split_mode: str,
) -> dict[str, dict]:
    from tff_algorithms.evaluation import scoring as evaluation

    return evaluation.compare_saved_models(
        model_dirs, records_dir, num_resamples, confidence, split_mode=split_mode
    )


def _far_key(far: float) -> str:
    return format(far, "g")


def _blessing_decision(
    epsilon: float,
    convention: str,
    budget: float,
    candidate_recall: float,
    baseline_recall: float | None,
    max_regression: float,
    versus_start: dict | None = None,
    confidence: float = 0.95,
) -> list[str]:
    """Reasons not to bless; empty when the model is blessed."""
    reasons = []
    if convention != accounting_spec.Convention.STRICT.value:
        reasons.append(
            f"epsilon was accounted under the {convention or 'unrecorded'} convention, not "
            "the strict one"
        )
    if not math.isfinite(epsilon):
        reasons.append("epsilon is infinite (no privacy)")
    elif epsilon > budget:
        reasons.append(f"epsilon {epsilon:.4g} exceeds the privacy budget {budget:.4g}")
    if baseline_recall is not None and candidate_recall < baseline_recall - max_regression:
        reasons.append(
            f"recall {candidate_recall:.4f} is below the last blessed model's {baseline_recall:.4f}"
        )
    # versus_start: the candidate's paired comparison with its pretrained start at the
    # gate FAR ({"difference", "interval"}, tff_algorithms.evaluation.scoring.compare_saved_models).
    if versus_start is not None and versus_start["interval"][1] < 0:
        low, high = versus_start["interval"]
        reasons.append(
            f"recall {candidate_recall:.4f} is significantly below its pretrained start's "
            f"{candidate_recall - versus_start['difference']:.4f} (difference "
            f"{versus_start['difference']:+.4f}, {confidence:.0%} paired interval "
            f"[{low:+.4f}, {high:+.4f}]): the privacy budget spent bought a worse model"
        )
    return reasons


@component
def EvaluateAndBless(
    model: InputArtifact[standard_artifacts.Model],
    privacy_ledger: InputArtifact[artifacts.PrivacyLedger],
    examples: InputArtifact[standard_artifacts.Examples],
    evaluation: OutputArtifact[standard_artifacts.ModelEvaluation],
    blessing: OutputArtifact[standard_artifacts.ModelBlessing],
    privacy_budget_epsilon: Parameter[float],
    gate_far: Parameter[float],
    max_recall_regression: Parameter[float],
    bootstrap_resamples: Parameter[int],
    confidence: Parameter[float],
    code_fingerprint: Parameter[str],
    baseline_model: InputArtifact[standard_artifacts.Model] = None,
    pretrained_backbone: InputArtifact[standard_artifacts.Model] = None,
) -> None:
    """Evaluates on the test split (what it holds depends on the split mode,
    beam_jobs.split_protocols.PROTOCOLS)."""
    from beam_jobs import split_protocols

    del code_fingerprint
    test_dir = layout.split_dir(examples, split_protocols.TEST)
    epsilon = privacy_ledger.get_float_custom_property(artifacts.EPSILON)
    if model.get_float_custom_property(artifacts.EPSILON) != epsilon:
        raise ValueError("the privacy ledger given is not the one of the model evaluated")
    # One comparison on the same images: the candidate's recall minus each other model's
    # comes with a paired bootstrap interval over held-out identities.
    model_dirs = {"candidate": layout.serving_model_dir(model)}
    if pretrained_backbone is not None:
        model_dirs["pretrained"] = layout.serving_model_dir(pretrained_backbone)
    if baseline_model is not None and baseline_model.id != model.id:
        model_dirs["baseline"] = layout.serving_model_dir(baseline_model)
    # The split mode says which pairs are genuine (held_out_images: across users only).
    results = _comparison(
        model_dirs, test_dir, bootstrap_resamples, confidence, layout.split_mode(examples)
    )
    candidate = results["candidate"]
    convention = privacy_ledger.get_string_custom_property(artifacts.ACCOUNTING_CONVENTION)
    report = {
        "model": {"uri": model.uri, "id": model.id, **candidate},
        "epsilon": epsilon,
        "delta": privacy_ledger.get_float_custom_property(artifacts.DELTA),
        "accounting_convention": convention,
        "neighboring_relation": privacy_ledger.get_string_custom_property(
            artifacts.NEIGHBORING_RELATION
        ),
        "privacy_budget_epsilon": privacy_budget_epsilon,
        "gate_far": gate_far,
        # The protocol the test split was made by: what the recall measures.
        "split_mode": layout.split_mode(examples),
        # Whether the test split came from data.evaluation_inputs (whose records they are).
        "evaluation_inputs": layout.has_evaluation_inputs(examples),
        "bootstrap": {"resamples": bootstrap_resamples, "confidence": confidence},
    }
    baseline_recall = None
    if baseline_model is not None:
        baseline = results.get("baseline", candidate)
        baseline_recall = baseline["recall_at_far"][_far_key(gate_far)]
        report["baseline"] = {"uri": baseline_model.uri, "id": baseline_model.id, **baseline}
    if pretrained_backbone is not None:
        report["pretrained"] = {"uri": pretrained_backbone.uri, **results["pretrained"]}
    reasons = _blessing_decision(
        epsilon,
        convention,
        privacy_budget_epsilon,
        candidate["recall_at_far"][_far_key(gate_far)],
        baseline_recall,
        max_recall_regression,
        candidate.get("versus", {}).get("pretrained", {}).get(_far_key(gate_far)),
        confidence,
    )
    report["blessed"] = not reasons
    report["not_blessed_because"] = reasons
    with tf.io.gfile.GFile(os.path.join(evaluation.uri, EVALUATION_FILE), "w") as f:
        f.write(json.dumps(report, indent=1))
    _mark(blessing, model, baseline_model, blessed=not reasons, reasons=reasons)
    for far, recall in candidate["recall_at_far"].items():
        evaluation.set_float_custom_property(f"recall_at_far_{far}", recall)
    evaluation.set_float_custom_property(artifacts.EPSILON, epsilon)
    evaluation.set_string_custom_property(artifacts.ACCOUNTING_CONVENTION, convention)


def _mark(
    blessing: types.Artifact,
    model: types.Artifact,
    baseline: types.Artifact | None,
    blessed: bool,
    reasons: list[str],
) -> None:
    with tf.io.gfile.GFile(
        os.path.join(blessing.uri, "BLESSED" if blessed else "NOT_BLESSED"), "w"
    ):
        pass
    blessing.set_int_custom_property("blessed", int(blessed))
    blessing.set_string_custom_property("current_model", model.uri)
    blessing.set_int_custom_property("current_model_id", model.id)
    if baseline is not None:
        blessing.set_string_custom_property("baseline_model", baseline.uri)
        blessing.set_int_custom_property("baseline_model_id", baseline.id)
    if reasons:
        blessing.set_string_custom_property("not_blessed_because", "; ".join(reasons))
