"""`pretrain.source: private_contrastive` through the pipeline (issue 26, item 3).

One run through the command line on tiny data: Logit-DP pretraining on the private
training users, then DP-FedEmb from its backbone. Both runs are charged to the budget
before either trains, and the pushed model's lineage, gate, report and model card show
the composed epsilon, which the test recomputes with dp_accounting directly.
"""

import json
import os

import pytest

from pipeline import definition, lineage
from pipeline.components import artifacts
from tests import support
from tff_algorithms.base import job_files

# One xdist worker for the whole module: its module fixture (minutes) is then built once,
# not once on each worker (tests/conftest.py leaves slow modules ungrouped).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("private_pretraining_pipeline")]

PRETRAIN_JOB = {
    "rounds": 3,
    "logit_dp": {"users_per_step": 14},
    "evaluate_every": 3,
    "noise_multiplier": 1.0,
    "noise_seed": 0,
    "testing_fixed_noise": True,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("private-pretraining")
    values = support.tiny_pipeline(
        str(root / "output"), pretrain={"source": "private_contrastive", "job": PRETRAIN_JOB}
    )
    return support.run_pipeline(values, root)


def _independent_composed_epsilon(pretrain_spec: dict, train_spec: dict, delta: float) -> float:
    """dp_accounting's RDP accountant over both runs' events, built here from the specs'
    numbers (not through the product's accounting): Logit-DP's noise multiplier is
    relative to its sensitivity; DP-FedEmb's strict one to 2 clip norms."""
    import dp_accounting

    def sampled(spec: dict, noise: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(
                spec["population"], spec["users_per_round"], dp_accounting.GaussianDpEvent(noise)
            ),
            spec["rounds"],
        )

    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    accountant.compose(sampled(pretrain_spec, pretrain_spec["noise_multiplier"]))
    accountant.compose(sampled(train_spec, train_spec["noise_multiplier"] / 2))
    return accountant.get_epsilon(delta)


def test_the_pushed_model_carries_the_composed_epsilon_everywhere(run):
    config, store, _ = run
    executions = support.executions_by_node(store)
    assert definition.PRIVATE_PRETRAIN in executions and definition.PRETRAIN not in executions
    [ledger_artifact] = store.get_artifacts_by_type(artifacts.PrivacyLedger.TYPE_NAME)
    with open(os.path.join(ledger_artifact.uri, job_files.COMPOSITION_FILE)) as f:
        composition = json.load(f)
    pretrain_run, train_run = composition["runs"]
    assert (pretrain_run["stage"], pretrain_run["mechanism"]) == ("PrivatePretrain", "logit_dp")
    assert (train_run["stage"], train_run["mechanism"]) == ("PrivateTrain", "dpsgd")
    assert pretrain_run["rounds"] == 3 and train_run["rounds"] == 2
    composed = composition["epsilon"]
    # Both runs are accounted with the (default) tight PLD and composed as PLDs: at most
    # dp_accounting's RDP composition of the same events.
    assert composed <= _independent_composed_epsilon(pretrain_run["spec"], train_run["spec"], 1e-3)
    assert composed > max(pretrain_run["epsilon"], train_run["epsilon"])
    # Lineage of the pushed model, the gate and the budget all see the composed value.
    [pushed] = lineage.pushed_models(store)
    privacy = lineage.privacy_of_pushed_model(store, pushed.id)
    assert privacy.epsilon == pytest.approx(composed)
    props = ledger_artifact.custom_properties
    assert props[artifacts.RUN_EPSILON].double_value == pytest.approx(train_run["epsilon"])
    assert props[artifacts.COMPOSED_RUNS].int_value == 2
    # The budget's charge (planned specs, before training) and the composition (the specs
    # the ledgers recorded) are two PLD compositions: seen to differ by 2e-8 relative.
    assert props[artifacts.DATASET_EPSILON].double_value == pytest.approx(composed, rel=1e-6)
    [evaluation] = store.get_artifacts_by_type("ModelEvaluation")
    with open(os.path.join(evaluation.uri, "evaluation.json")) as f:
        assert json.load(f)["epsilon"] == pytest.approx(composed)
    # Report and model card name the composed value and both runs.
    shown = f"{composed:.2f}"
    with open(os.path.join(privacy.pushed_destination, "model_card.json")) as f:
        card = json.load(f)
    assert f"ε = {shown}" in card["model_details"]["overview"]
    assert "Logit-DP contrastive pretraining" in card["model_details"]["documentation"]
    [report] = store.get_artifacts_by_type(artifacts.PipelineReport.TYPE_NAME)
    page = open(os.path.join(report.uri, "index.html")).read()
    assert f"ε = {shown}" in page and "all its private runs, composed" in page


def test_both_runs_were_charged_once_before_either_trained(run):
    config, store, _ = run
    with open(config.budget_policy_dict()["ledger_path"]) as f:
        [dataset] = json.load(f)["datasets"].values()
    pretrain_entry, train_entry = dataset["runs"]
    assert pretrain_entry["charged_with"] == train_entry["charged_with"]
    assert pretrain_entry["spec"]["mechanism"] == "logit_dp"
    assert train_entry["spec"]["mechanism"] == "dpsgd"
    # Both charged in PrivatePretrain's one transaction, before PrivateTrain began.
    executions = support.executions_by_node(store)
    [pretrain] = executions[definition.PRIVATE_PRETRAIN]
    [train] = executions[definition.PRIVATE_TRAIN]
    assert pretrain_entry["charged_at"] == pytest.approx(train_entry["charged_at"], abs=1.0)
    assert pretrain.create_time_since_epoch / 1000 <= pretrain_entry["charged_at"]
    assert train_entry["charged_at"] < train.create_time_since_epoch / 1000


def test_the_backbone_carries_its_own_epsilon_and_ledger(run):
    _, store, _ = run
    [backbone] = [
        m
        for m in store.get_artifacts_by_type("Model")
        if m.custom_properties.get("trained_on")
        and m.custom_properties["trained_on"].string_value == "private_contrastive"
    ]
    with open(os.path.join(backbone.uri, job_files.LEDGER_FILE)) as f:
        ledger = json.load(f)
    assert backbone.custom_properties[artifacts.EPSILON].double_value == pytest.approx(
        ledger["history"][-1]["epsilon"]
    )
    assert sorted(os.listdir(backbone.uri)) == ["Format-Serving", job_files.LEDGER_FILE]


def test_the_console_shows_each_step_and_nothing_on_stderr(run):
    """Progress of the private pretraining like training's; the per-example loop's
    TensorFlow warnings stay out of the console (stderr empty)."""
    _, _, process = run
    assert process.stderr == ""
    lines = process.stdout.splitlines()
    steps = PRETRAIN_JOB["rounds"]
    assert any(
        line.startswith(f"{definition.PRIVATE_PRETRAIN} round {steps}/{steps}  ") and "ε " in line
        for line in lines
    )
    assert any(f"] {definition.PRIVATE_PRETRAIN}: done in " in line for line in lines)
