"""The blessing gate against the pretrained start (issue 38 item 7): a private model
significantly worse than the backbone it trained from is never pushed."""

from pipeline.components import evaluation
from tff_algorithms.privacy import accounting_spec

STRICT = accounting_spec.Convention.STRICT.value


def _decision(versus_start: dict | None, baseline_recall: float | None = None) -> list[str]:
    return evaluation._blessing_decision(
        epsilon=7.9,
        convention=STRICT,
        budget=8.0,
        candidate_recall=0.40,
        baseline_recall=baseline_recall,
        max_regression=0.0,
        versus_start=versus_start,
        confidence=0.95,
    )


def test_a_first_model_significantly_below_its_start_is_refused_saying_why():
    # The run: -0.011 [-0.022, -0.001] at the gate FAR, and no last blessed model.
    reasons = _decision({"difference": -0.011, "interval": [-0.022, -0.001]})
    assert len(reasons) == 1
    assert "significantly below its pretrained start's 0.4110" in reasons[0]
    assert "[-0.0220, -0.0010]" in reasons[0] and "privacy budget spent" in reasons[0]


def test_a_model_not_significantly_below_its_start_is_blessed():
    assert _decision({"difference": -0.004, "interval": [-0.012, 0.003]}) == []
    assert _decision({"difference": 0.05, "interval": [0.03, 0.07]}) == []
    assert _decision(None) == []


def test_both_gates_give_their_reasons():
    reasons = _decision({"difference": -0.1, "interval": [-0.15, -0.05]}, baseline_recall=0.45)
    assert len(reasons) == 2 and "last blessed model" in reasons[0]
