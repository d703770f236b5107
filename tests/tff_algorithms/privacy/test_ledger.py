"""Tests of tff_algorithms.privacy.ledger: per-round recording, JSON checkpointing and resume."""

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tff_algorithms.privacy import accounting
from tff_algorithms.privacy.accounting_spec import AccountingSpec
from tff_algorithms.privacy.ledger import PrivacyLedger

SGD = AccountingSpec(20_000, 200, 12, 0.8, 1e-6)
TREE = AccountingSpec(
    1000, 100, 25, 3.0, 1e-6, mechanism="dpftrl", users_per_virtual_client=4,
    restart_every_epoch=True,
)  # fmt: skip


def record(ledger: PrivacyLedger, first: int, last: int) -> None:
    for round_number in range(first, last + 1):
        ledger.record_round(round_number)


@pytest.mark.parametrize("spec", [SGD, TREE], ids=["dpsgd", "dpftrl-restart"])
def test_each_round_costs_what_the_accountant_says(spec):
    ledger = PrivacyLedger(spec)
    assert ledger.epsilon == 0.0
    record(ledger, 1, spec.rounds)
    for entry in ledger.history:
        expected = accounting.compute_privacy(spec.with_rounds(entry.round))
        assert entry.epsilon == expected.epsilon
        assert entry.zcdp_rho == expected.zcdp_rho
    epsilons = [entry.epsilon for entry in ledger.history]
    assert epsilons == sorted(epsilons)
    assert ledger.epsilon == accounting.compute_privacy(spec).epsilon


@settings(max_examples=8, deadline=None)
@given(stop=st.integers(0, SGD.rounds), spec=st.sampled_from([SGD, TREE]))
def test_resume_from_json_equals_uninterrupted(stop, spec):
    uninterrupted = PrivacyLedger(spec)
    record(uninterrupted, 1, spec.rounds)

    before = PrivacyLedger(spec)
    record(before, 1, min(stop, spec.rounds))
    resumed = PrivacyLedger.from_json(before.to_json(), expected_spec=spec)
    record(resumed, resumed.rounds_recorded + 1, spec.rounds)

    assert resumed == uninterrupted
    assert resumed.to_json() == uninterrupted.to_json()


def test_format_1_ledgers_are_accounted_again_under_the_strict_convention():
    """Ledgers written before the convention held the paper's arithmetic; read back,
    the stored schedule is accounted under strict and the stale epsilons are dropped."""
    paper = PrivacyLedger(dataclasses.replace(SGD, convention="paper"))
    record(paper, 1, 5)
    old = paper.to_dict()
    old["format"] = "dp-fedemb-privacy-ledger/1"
    del old["spec"]["convention"]
    restored = PrivacyLedger.from_dict(old, expected_spec=SGD)
    strict = PrivacyLedger(SGD)
    record(strict, 1, 5)
    assert restored == strict
    assert restored.epsilon > 1.5 * paper.epsilon
    assert restored.to_dict()["format"] == "dp-fedemb-privacy-ledger/2"
    # Trees are accounted alike by both conventions: their entries are kept.
    tree = PrivacyLedger(TREE)
    record(tree, 1, 3)
    old_tree = tree.to_dict()
    old_tree["format"] = "dp-fedemb-privacy-ledger/1"
    del old_tree["spec"]["convention"]
    assert PrivacyLedger.from_dict(old_tree, expected_spec=TREE) == tree


def test_double_count_and_skip_are_errors():
    ledger = PrivacyLedger(SGD)
    record(ledger, 1, 3)
    with pytest.raises(ValueError, match="already recorded"):
        ledger.record_round(3)
    with pytest.raises(ValueError, match="round 4 is missing"):
        ledger.record_round(5)
    restored = PrivacyLedger.from_json(ledger.to_json())
    with pytest.raises(ValueError, match="already recorded"):
        restored.record_round(1)
    assert restored.rounds_recorded == 3  # the failed calls recorded nothing


def test_rounds_beyond_the_spec_are_errors():
    ledger = PrivacyLedger(SGD.with_rounds(2))
    record(ledger, 1, 2)
    with pytest.raises(ValueError, match="exceeds the 2 rounds"):
        ledger.record_round(3)


def test_resume_under_another_spec_is_refused():
    ledger = PrivacyLedger(SGD)
    record(ledger, 1, 2)
    other = SGD.with_noise_multiplier(1.0)
    with pytest.raises(ValueError, match="different accounting spec"):
        PrivacyLedger.from_json(ledger.to_json(), expected_spec=other)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not valid JSON"),
        ('{"format": "something else"}', "not a privacy ledger"),
        ('{"format": "dp-fedemb-privacy-ledger/1", "spec": {}}', "incomplete accounting spec"),
    ],
)
def test_corrupt_ledgers_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        PrivacyLedger.from_json(text)


def test_gap_in_saved_history_is_refused():
    ledger = PrivacyLedger(SGD)
    record(ledger, 1, 3)
    data = ledger.to_dict()
    del data["history"][1]
    with pytest.raises(ValueError, match="entry 2 is for round 3"):
        PrivacyLedger.from_dict(data)


def test_zero_noise_round_trips_as_strict_json():
    ledger = PrivacyLedger(TREE.with_noise_multiplier(0.0))
    record(ledger, 1, 2)
    text = ledger.to_json()
    assert json.loads(text)["history"][0]["epsilon"] is None  # no Infinity literal
    restored = PrivacyLedger.from_json(text)
    assert math.isinf(restored.epsilon) and math.isinf(restored.history[-1].zcdp_rho)
    assert restored == ledger


def test_epsilon_at():
    ledger = PrivacyLedger(SGD)
    record(ledger, 1, 4)
    assert ledger.epsilon_at(0) == 0.0
    assert ledger.epsilon_at(2) == ledger.history[1].epsilon
    with pytest.raises(ValueError, match="not recorded"):
        ledger.epsilon_at(5)
