"""The cross-run privacy budget: composition, fingerprints, charging, refusal, override."""

import dataclasses
import json
import os

import dp_accounting
import pytest

from beam_jobs import partition, synthetic
from tests import support
from tff_algorithms.base import job_files
from tff_algorithms.config import job_config, job_plan
from tff_algorithms.jobs import train_job
from tff_algorithms.privacy import accounting, accounting_spec, budget

DPSGD = accounting_spec.AccountingSpec(
    population=1000, users_per_round=50, rounds=40, noise_multiplier=1.1, delta=1e-5
)
DPFTRL = accounting_spec.AccountingSpec(
    population=1000,
    users_per_round=50,
    rounds=40,
    noise_multiplier=4.0,
    delta=1e-5,
    mechanism=accounting_spec.Mechanism.DPFTRL,
    users_per_virtual_client=2,
    restart_every_epoch=True,
)


def _dp_accounting_epsilon(specs, relation, delta: float) -> float:
    """dp_accounting's own RDP accountant over one ComposedDpEvent of every run."""
    rdp = dp_accounting.rdp.RdpAccountant(
        orders=accounting.RDP_ORDERS, neighboring_relation=relation
    )
    rdp.compose(dp_accounting.ComposedDpEvent([accounting.dp_event_for(s) for s in specs]))
    return rdp.get_epsilon(delta)


def test_rdp_runs_compose_as_dp_accountings_rdp_accountant_and_tighter_than_summed_epsilon():
    """Runs accounted with RDP (ledgers written before PLD was the default, or a mixed
    ledger) compose by summed RDP curves."""
    first = dataclasses.replace(DPSGD, accountant="rdp")
    second = dataclasses.replace(first, rounds=25, noise_multiplier=0.9)
    composed = budget.composed_epsilon([first, second], DPSGD.delta)
    expected = _dp_accounting_epsilon(
        [first, second], dp_accounting.NeighboringRelation.REPLACE_ONE, DPSGD.delta
    )
    assert composed == pytest.approx(expected, rel=1e-9)
    alone = [accounting.compute_privacy(s).epsilon for s in (first, second)]
    assert max(alone) < composed < sum(alone)
    # One run composes to its own ledger epsilon.
    assert budget.composed_epsilon([first], DPSGD.delta) == pytest.approx(alone[0], rel=1e-12)
    # One RDP run among PLD runs: all compose by RDP, the same number.
    mixed = budget.composed_epsilon([DPSGD, second], DPSGD.delta)
    assert mixed == pytest.approx(expected, rel=1e-9)


def test_pld_runs_compose_as_one_longer_run():
    """Runs accounted with the (default) PLD compose their PLDs: two runs of the same
    schedule cost what one run of their rounds together costs, less than RDP says."""
    assert DPSGD.accountant is accounting_spec.Accountant.PLD
    second = dataclasses.replace(DPSGD, rounds=25)
    composed = budget.composed_epsilon([DPSGD, second], DPSGD.delta)
    together = accounting.compute_privacy(DPSGD.with_rounds(65)).epsilon
    assert composed == pytest.approx(together, rel=1e-6)
    alone = [accounting.compute_privacy(s).epsilon for s in (DPSGD, second)]
    assert max(alone) < composed < sum(alone)
    rdp = _dp_accounting_epsilon(
        [DPSGD, second], dp_accounting.NeighboringRelation.REPLACE_ONE, DPSGD.delta
    )
    assert composed < rdp
    assert budget.composed_epsilon([DPSGD], DPSGD.delta) == pytest.approx(alone[0], rel=1e-12)


def test_tree_runs_compose_under_the_special_element_relation():
    second = dataclasses.replace(DPFTRL, rounds=60)
    composed = budget.composed_epsilon([DPFTRL, second], DPFTRL.delta)
    expected = _dp_accounting_epsilon(
        [DPFTRL, second], dp_accounting.NeighboringRelation.REPLACE_SPECIAL, DPFTRL.delta
    )
    assert composed == pytest.approx(expected, rel=1e-9)
    # Mixed mechanisms: the joint guarantee is stated under the weaker relation.
    assert (
        budget.composition_relation([DPSGD, DPFTRL])
        is accounting_spec.NeighboringRelation.REPLACE_SPECIAL
    )
    mixed = budget.composed_epsilon([DPSGD, DPFTRL], DPSGD.delta)
    alone = [accounting.compute_privacy(s).epsilon for s in (DPSGD, DPFTRL)]
    assert max(alone) < mixed < sum(alone)


def test_composition_refuses_runs_without_a_cross_run_analysis():
    poisson = dataclasses.replace(
        DPSGD, sampling="poisson", neighboring_relation="add_or_remove_one"
    )
    with pytest.raises(ValueError, match="no cross-run composition"):
        budget.composed_epsilon([DPSGD, poisson], 1e-5)
    assert budget.composed_epsilon([DPSGD, DPSGD.with_noise_multiplier(0.0)], 1e-5) == float("inf")
    assert budget.composed_epsilon([], 1e-5) == 0.0


def test_fingerprint_is_of_the_user_set():
    users = ["u1", "u2", "u3"]
    assert budget.dataset_fingerprint(users) == budget.dataset_fingerprint(["u3", "u1", "u2", "u1"])
    assert budget.dataset_fingerprint(users) != budget.dataset_fingerprint(users[:2])
    assert budget.dataset_fingerprint(["ab", "c"]) != budget.dataset_fingerprint(["a", "bc"])


def test_charging_accumulates_refuses_over_budget_and_records_an_override(tmp_path):
    path = str(tmp_path / "ledger.json")
    fingerprint = budget.dataset_fingerprint(["a", "b"])
    one = accounting.compute_privacy(DPSGD).epsilon
    twice = budget.composed_epsilon([DPSGD, DPSGD], DPSGD.delta)
    policy = budget.BudgetPolicy(path, total_epsilon=(twice + one) / 2)  # fits one run, not two

    first = budget.charge_run(policy, fingerprint, 1000, "run-1", DPSGD)
    assert (first.runs, first.overridden, first.resumed) == (1, False, False)
    assert first.spent_before == 0 and first.spent_after == pytest.approx(one)
    # A resumed run (same run id) is charged once.
    again = budget.charge_run(policy, fingerprint, 1000, "run-1", DPSGD)
    assert again.resumed and again.runs == 1 and again.spent_after == pytest.approx(one)

    before = open(path, "rb").read()
    with pytest.raises(ValueError, match="dataset privacy budget exceeded") as refused:
        budget.charge_run(policy, fingerprint, 1000, "run-2", DPSGD)
    assert "\n" not in str(refused.value)
    assert open(path, "rb").read() == before  # a refused run is not charged

    overridden = budget.charge_run(
        dataclasses.replace(policy, override=True), fingerprint, 1000, "run-2", DPSGD
    )
    assert overridden.overridden and overridden.spent_after == pytest.approx(twice)
    entries = json.load(open(path))["datasets"][fingerprint]["runs"]
    assert [(e["run_id"], e["overridden"]) for e in entries] == [
        ("run-1", False),
        ("run-2", True),
    ]
    assert budget.dataset_spent(path, fingerprint, DPSGD.delta) == pytest.approx(twice)
    # Other users have their own budget.
    other = budget.charge_run(policy, budget.dataset_fingerprint(["c"]), 1, "run-3", DPSGD)
    assert other.runs == 1 and other.spent_before == 0


LOGIT_DP = accounting_spec.AccountingSpec(
    population=1000,
    users_per_round=32,
    rounds=40,
    noise_multiplier=1.0,
    delta=1e-5,
    mechanism=accounting_spec.Mechanism.LOGIT_DP,
)


def test_runs_planned_together_are_charged_together_or_not_at_all(tmp_path):
    path = str(tmp_path / "ledger.json")
    fingerprint = budget.dataset_fingerprint(["a", "b"])
    both = budget.composed_epsilon([LOGIT_DP, DPSGD], DPSGD.delta)
    # Both runs count (more than either alone), and the PLD composition is at most
    # dp_accounting's RDP composition of the two runs' own events.
    alone = [accounting.compute_privacy(s).epsilon for s in (LOGIT_DP, DPSGD)]
    assert (
        max(alone)
        < both
        <= _dp_accounting_epsilon(
            [LOGIT_DP, DPSGD], dp_accounting.NeighboringRelation.REPLACE_ONE, DPSGD.delta
        )
    )
    runs = [("pre", LOGIT_DP, None), ("train", DPSGD, None)]
    # A budget that fits the training alone refuses both, and writes nothing.
    tight = budget.BudgetPolicy(
        path, total_epsilon=accounting.compute_privacy(DPSGD).epsilon * 1.001
    )
    with pytest.raises(ValueError, match="refusing to start either") as refused:
        budget.charge_runs(tight, fingerprint, 1000, runs)
    assert "\n" not in str(refused.value)
    assert not os.path.exists(path) or fingerprint not in json.load(open(path))["datasets"]

    policy = budget.BudgetPolicy(path, total_epsilon=both * 1.001)
    assert budget.charge_runs(policy, fingerprint, 1000, runs) == pytest.approx(both)
    entries = json.load(open(path))["datasets"][fingerprint]["runs"]
    assert [e["run_id"] for e in entries] == ["pre", "train"]
    assert all(e["charged_with"] == ["pre", "train"] for e in entries)
    # Each run, when it starts, finds its charge: resumed, not charged twice.
    for run_id, spec, _ in runs:
        charge = budget.charge_run(policy, fingerprint, 1000, run_id, spec)
        assert charge.resumed and charge.spent_after == pytest.approx(both)
    # Retrying the pair charges nothing more; another schedule under the same id is refused.
    assert budget.charge_runs(policy, fingerprint, 1000, runs) == pytest.approx(both)
    with pytest.raises(ValueError, match="another accounting spec"):
        budget.charge_runs(policy, fingerprint, 1000, [("train", LOGIT_DP, None)])
    assert len(json.load(open(path))["datasets"][fingerprint]["runs"]) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ledger_path": "", "total_epsilon": 1.0}, "must not be empty"),
        ({"ledger_path": "gs://b/l.json", "total_epsilon": 1.0}, "local or mounted"),
        ({"ledger_path": "l.json", "total_epsilon": 0.0}, "finite and > 0"),
        ({"ledger_path": "l.json", "total_epsilon": float("inf")}, "finite and > 0"),
        ({"ledger_path": "l.json", "total_epsilon": 1.0, "override": "yes"}, "true or false"),
    ],
)
def test_policy_rejects_nonsense(kwargs, message):
    with pytest.raises(ValueError, match=message):
        budget.BudgetPolicy(**kwargs)


def test_a_corrupt_ledger_is_an_error_not_a_fresh_budget(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text("{not json")
    policy = budget.BudgetPolicy(str(path), 10.0)
    with pytest.raises(ValueError, match="not valid JSON"):
        budget.charge_run(policy, "f", 1, "r", DPSGD)


def test_entries_from_before_the_convention_are_recomputed_strict(tmp_path):
    """A ledger written before the convention existed stores specs without one and the
    old (paper-arithmetic) epsilons beside them: the budget is recomputed from the
    schedule under the strict convention, never taken from the stored numbers."""
    paper = dataclasses.replace(DPSGD, convention="paper")
    legacy_spec = {k: v for k, v in DPSGD.to_dict().items() if k != "convention"}
    stale = accounting.compute_privacy(paper).epsilon
    path = tmp_path / "budget.json"
    path.write_text(
        json.dumps(
            {
                "format": budget.BUDGET_LEDGER_FORMAT,
                "fingerprint": budget.FINGERPRINT_SCHEME,
                "datasets": {
                    "f": {
                        "users": 1000,
                        "runs": [
                            {"run_id": "old", "spec": legacy_spec, "run_epsilon": stale,
                             "spent_after": stale, "total_epsilon": 50.0, "overridden": False,
                             "charged_at": 0.0},
                        ],
                    }
                },
            }
        )
    )  # fmt: skip
    strict = accounting.compute_privacy(DPSGD).epsilon
    assert strict > 1.5 * stale
    assert budget.dataset_spent(str(path), "f", DPSGD.delta) == pytest.approx(strict, rel=1e-9)


def test_paper_convention_runs_cannot_be_charged(tmp_path):
    policy = budget.BudgetPolicy(str(tmp_path / "budget.json"), total_epsilon=100.0)
    with pytest.raises(ValueError, match="paper-convention run cannot count"):
        budget.charge_run(policy, "f", 1000, "r", dataclasses.replace(DPSGD, convention="paper"))
    assert not (tmp_path / "budget.json").exists()


SYNTH = synthetic.SyntheticConfig(identities=24, images_per_identity=4, seed=3)
JOB = job_config.TrainJobConfig(
    rounds=1,
    noise_multiplier=0.8,
    users_per_virtual_client=2,
    virtual_clients_per_round=2,
    batch_size=8,
    head_capacity=4,
    embedding_size=16,
    evaluate_every=0,
)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("budget_data"), SYNTH, train_identities=20
    )


@pytest.mark.slow
def test_train_job_is_charged_once_and_a_second_job_over_budget_refused(
    tff_runtime, small_data, tmp_path
):
    spec = job_plan.accounting_spec_for(JOB, 20)
    one = accounting.compute_privacy(spec).epsilon
    twice = budget.composed_epsilon([spec, spec], spec.delta)
    policy = budget.BudgetPolicy(str(tmp_path / "budget.json"), total_epsilon=(one + twice) / 2)
    first_dir = str(tmp_path / "first")
    result = train_job.run_train_job(JOB, *small_data, first_dir, budget=policy)
    charge = result.metrics["dataset_budget"]
    users = partition.PartitionReader(small_data[0]).user_ids()
    assert charge["fingerprint"] == budget.dataset_fingerprint(users)
    assert charge["spent_after"] == pytest.approx(result.epsilon)
    assert charge["runs"] == 1 and not charge["overridden"]
    # Re-running the finished job (a resume) is not charged again.
    rerun = train_job.run_train_job(JOB, *small_data, first_dir, budget=policy)
    assert (
        rerun.metrics["dataset_budget"]["resumed"] and rerun.metrics["dataset_budget"]["runs"] == 1
    )

    second_dir = str(tmp_path / "second")
    with pytest.raises(ValueError, match="dataset privacy budget exceeded"):
        train_job.run_train_job(JOB, *small_data, second_dir, budget=policy)
    assert not os.path.exists(os.path.join(second_dir, job_files.CHECKPOINT_DIR))


def test_the_budget_is_fixed_by_the_first_charge_and_a_change_is_an_override(tmp_path):
    path = str(tmp_path / "ledger.json")
    fingerprint = budget.dataset_fingerprint(["a", "b"])
    budget.charge_run(budget.BudgetPolicy(path, 40.0), fingerprint, 1000, "run-1", DPSGD)
    before = open(path, "rb").read()
    for asked in (60.0, 20.0):
        with pytest.raises(ValueError, match="fixed the budget .* at epsilon 40") as refused:
            budget.charge_run(budget.BudgetPolicy(path, asked), fingerprint, 1000, "run-2", DPSGD)
        assert "\n" not in str(refused.value)
    assert open(path, "rb").read() == before
    raised = budget.charge_run(
        budget.BudgetPolicy(path, 60.0, override=True), fingerprint, 1000, "run-2", DPSGD
    )
    assert raised.overridden and raised.total_epsilon == 40.0
    entry = json.load(open(path))["datasets"][fingerprint]
    assert entry["budget_epsilon"] == 40.0
    assert (entry["runs"][1]["overridden"], entry["runs"][1]["requested_epsilon"]) == (True, 60.0)
    # The first budget still holds for the next run that asks for 30 without override.
    with pytest.raises(ValueError, match="fixed the budget"):
        budget.charge_run(budget.BudgetPolicy(path, 60.0), fingerprint, 1000, "run-3", DPSGD)


def test_a_ledger_written_before_the_fixed_budget_keeps_its_first_runs_budget(tmp_path):
    path = tmp_path / "ledger.json"
    fingerprint = budget.dataset_fingerprint(["a"])
    budget.charge_run(budget.BudgetPolicy(str(path), 40.0), fingerprint, 1000, "run-1", DPSGD)
    data = json.loads(path.read_text())
    del data["datasets"][fingerprint]["budget_epsilon"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="at epsilon 40"):
        budget.charge_run(budget.BudgetPolicy(str(path), 60.0), fingerprint, 1000, "r2", DPSGD)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_text(""), "is empty"),
        (lambda p: p.chmod(0o444), r"not readable and writable \(mode 0444\)"),
        (lambda p: p.chmod(0o200), r"not readable and writable \(mode 0200\)"),
    ],
)
def test_an_empty_or_locked_ledger_is_refused_never_replaced(tmp_path, damage, message):
    path = tmp_path / "ledger.json"
    fingerprint = budget.dataset_fingerprint(["a"])
    policy = budget.BudgetPolicy(str(path), 40.0)
    budget.charge_run(policy, fingerprint, 1000, "run-1", DPSGD)
    damage(path)
    before = (path.read_bytes() if os.stat(path).st_mode & 0o400 else None, os.stat(path))
    with pytest.raises(ValueError, match=message) as refused:
        budget.charge_run(policy, fingerprint, 1000, "run-2", DPSGD)
    assert "\n" not in str(refused.value)
    after = os.stat(path)
    assert (after.st_ino, after.st_mode, after.st_size) == (
        before[1].st_ino,
        before[1].st_mode,
        before[1].st_size,
    )
