"""Plain-language privacy wording and human labels, from a run's privacy ledger.

The report and the model card both open with `privacy_statement`. Every number in it
comes from the ledger (`tff_algorithms.privacy.ledger` format: `spec` is an
`accounting_spec.AccountingSpec` as a dict, `history` the epsilon after each round), and
every name from the accounting enums, so the wording cannot drift from what was
accounted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tff_algorithms.privacy import accounting_spec

_RELATION_CHANGE = {
    accounting_spec.NeighboringRelation.REPLACE_ONE.value: (
        "replacing all of any one user's images with another user's"
    ),
    accounting_spec.NeighboringRelation.ADD_OR_REMOVE_ONE.value: (
        "adding or removing all of any one user's images"
    ),
    accounting_spec.NeighboringRelation.REPLACE_SPECIAL.value: (
        "adding or removing all of any one user's images"
    ),
}
RELATION_LABELS = {
    accounting_spec.NeighboringRelation.REPLACE_ONE.value: "substitute one user (replace_one)",
    accounting_spec.NeighboringRelation.ADD_OR_REMOVE_ONE.value: "add or remove one user",
    accounting_spec.NeighboringRelation.REPLACE_SPECIAL.value: (
        "add or remove one user, with a special element (replace_special)"
    ),
}
ACCOUNTANT_LABELS = {
    accounting_spec.Accountant.RDP.value: "RDP (Rényi differential privacy, dp_accounting)",
    accounting_spec.Accountant.PLD.value: (
        "PLD (privacy loss distributions, dp_accounting; for fixed-size sampling the tight "
        "dominating pair of docs/privacy.md)"
    ),
}
# How a report names a mechanism, a private run of it in a model's composition, and its
# rounds: its `Release` says (`accounting_spec.RELEASES`).
MECHANISM_LABELS = {m.value: release.label for m, release in accounting_spec.RELEASES.items()}
STAGE_LABELS = {m.value: release.stage for m, release in accounting_spec.RELEASES.items()}
ROUND_UNITS = {m.value: release.step for m, release in accounting_spec.RELEASES.items()}
SAMPLING_LABELS = {
    accounting_spec.Sampling.UNIFORM.value: "a fixed number of users drawn without replacement each round",
    accounting_spec.Sampling.POISSON.value: "each user independently with probability M / N",
    accounting_spec.Sampling.EPOCH.value: "each user at most once per epoch",
    accounting_spec.Sampling.FULL.value: "every user in every round (no sampling)",
}
CONVENTION_LABELS = {
    accounting_spec.Convention.STRICT.value: "strict",
    accounting_spec.Convention.PAPER.value: "paper (comparison only: understates epsilon)",
}


def final_epsilon(ledger: Mapping[str, Any]) -> float:
    """Epsilon after the last recorded round; inf when trained without noise."""
    history = ledger.get("history") or []
    if not history:
        return 0.0
    value = history[-1]["epsilon"]
    return math.inf if value is None else float(value)


def sensitivity_in_clips(spec: Mapping[str, Any]) -> float:
    return accounting_spec.AccountingSpec.from_dict(dict(spec)).sensitivity_in_clips


def convention_text(spec: Mapping[str, Any]) -> str:
    label = CONVENTION_LABELS.get(spec["convention"], spec["convention"])
    return f"{label} (L2 sensitivity {sensitivity_in_clips(spec):g} × clip norm)"


def format_epsilon(epsilon: float) -> str:
    return "∞" if math.isinf(epsilon) else f"{epsilon:.2f}"


def model_epsilon(ledger: Mapping[str, Any], composition: Mapping[str, Any] | None) -> float:
    """The model's epsilon: composed over its private runs when a composition is given
    (tff_algorithms.privacy.composition), else the training ledger's."""
    if composition is None:
        return final_epsilon(ledger)
    return math.inf if composition["epsilon"] is None else float(composition["epsilon"])


def _stage_text(run: Mapping[str, Any]) -> str:
    epsilon = math.inf if run["epsilon"] is None else float(run["epsilon"])
    what = STAGE_LABELS.get(run["mechanism"], run["mechanism"])
    return f"{what} ({int(run['rounds']):,} {ROUND_UNITS.get(run['mechanism'], 'rounds')}, ε = {format_epsilon(epsilon)})"


def composition_text(composition: Mapping[str, Any] | None) -> str:
    """'' for a model from one private run; else which runs its epsilon composes."""
    if composition is None or len(composition["runs"]) < 2:
        return ""
    stages = " and ".join(_stage_text(run) for run in composition["runs"])
    return (
        f" ε composes every private run on these users that the model's weights come from: "
        f"{stages}; their RDP curves summed, not the last run's ε alone."
    )


# Whose the test records are when they come from data.evaluation_inputs (mode
# held_out_images; beam_jobs.split_protocols, evaluation sources).
EVALUATION_INPUTS_TEXT = (
    "the test records come from data.evaluation_inputs, a source apart from the private "
    "users: images of training identities by users who are not training users, none of "
    "them trained on and none covered by the guarantee, which is the training users'; "
    "the private users held out fill the validation split only"
)


def split_protocol_text(split_mode: str, evaluation_inputs: bool = False) -> str:
    """What the split mode (beam_jobs.split_protocols) means for the guarantee and the recall;
    `evaluation_inputs`: the test split came from data.evaluation_inputs."""
    from beam_jobs import split_protocols

    protocol = split_protocols.PROTOCOLS[split_mode]
    evaluated = EVALUATION_INPUTS_TEXT if evaluation_inputs else protocol.evaluation
    return (
        f"Evaluation protocol (split mode {split_mode}): {evaluated}; "
        f"{protocol.outside_guarantee}. Recall@FAR measures {protocol.recall_measures}."
    )


def _coverage(split_mode: str | None, evaluation_inputs: bool) -> str:
    from beam_jobs import split_protocols

    if split_mode in (None, split_protocols.IDENTITY_AND_USER):
        return "it does not cover the public pretraining data or the held-out evaluation users."
    source = f"; {EVALUATION_INPUTS_TEXT}" if evaluation_inputs else ""
    return (
        f"it does not cover the public pretraining data; in split mode {split_mode} "
        f"{split_protocols.PROTOCOLS[split_mode].outside_guarantee}{source}."
    )


def privacy_statement(
    ledger: Mapping[str, Any],
    composition: Mapping[str, Any] | None = None,
    split_mode: str | None = None,
    evaluation_inputs: bool = False,
) -> str:
    """One paragraph saying what the trained model's (epsilon, delta) guarantee means;
    `split_mode` (beam_jobs.split_protocols.MODES) and `evaluation_inputs` (the test split came
    from data.evaluation_inputs) say whose records are outside it."""
    spec = ledger["spec"]
    epsilon, delta = model_epsilon(ledger, composition), float(spec["delta"])
    relation = spec["neighboring_relation"]
    details = (
        f"Unit: user (all of one user's images together). Neighbouring relation: "
        f"{RELATION_LABELS.get(relation, relation)}. Accountant: "
        f"{ACCOUNTANT_LABELS.get(spec['accountant'], spec['accountant'])}. Convention: "
        f"{convention_text(spec)}."
    )
    if math.isinf(epsilon):
        return (
            "This model was trained without privacy noise: it carries no differential "
            "privacy guarantee for the users whose images trained it. " + details
        )
    factor = math.exp(epsilon)
    factor_text = f"{factor:.3g}" if factor < 10 or factor >= 1e6 else f"{factor:,.0f}"
    return (
        f"User-level differential privacy with ε = {format_epsilon(epsilon)} and "
        f"δ = {delta:g}: {_RELATION_CHANGE.get(relation, 'changing any one user')} changed "
        f"the chance of any output of training (this model, and anything computed from it "
        f"alone) by at most a factor e^ε = e^{format_epsilon(epsilon)} ≈ {factor_text}, "
        f"except with probability at most δ = {delta:g}. This covers the "
        f"{spec['population']:,} training users over all {spec['rounds']:,} rounds; "
        + _coverage(split_mode, evaluation_inputs)
        + composition_text(composition)
        + " "
        + details
    )


def accounting_rows(
    ledger: Mapping[str, Any], composition: Mapping[str, Any] | None = None
) -> list[tuple[str, str]]:
    """The accounting spec as (human label, value with unit) rows; with a composition of
    several runs, first the model's composed epsilon and each run's."""
    composed = []
    if composition is not None and len(composition["runs"]) > 1:
        composed = [
            (
                "ε of the model (all its private runs, composed)",
                format_epsilon(model_epsilon(ledger, composition)),
            )
        ] + [(f"ε of {run['stage']}", _stage_text(run)) for run in composition["runs"]]
    spec = ledger["spec"]
    k = int(spec.get("users_per_virtual_client", 1))
    users_per_round = int(spec["users_per_round"])
    rows = composed + [
        (
            "ε after the last round" + (" of the training" if composed else ""),
            format_epsilon(final_epsilon(ledger)),
        ),
        *(
            [("ε by the RDP accountant (cross-check)", format_epsilon(ledger["epsilon_rdp"]))]
            if ledger.get("epsilon_rdp") is not None and not composed
            else []
        ),
        ("δ", f"{float(spec['delta']):g}"),
        ("training users (population N)", f"{int(spec['population']):,} users"),
        (
            "users per round (M)",
            f"{users_per_round:,} users"
            + (f" ({users_per_round // k:,} virtual clients of {k} users)" if k > 1 else ""),
        ),
        ("rounds (T)", f"{int(spec['rounds']):,} rounds"),
        ("noise multiplier z", f"{float(spec['noise_multiplier']):.4g} (noise std / clip norm)"),
        (
            "noise multiplier given to the accountant",
            f"{float(spec['noise_multiplier']) / sensitivity_in_clips(spec):.4g} "
            "(z / sensitivity in clips)",
        ),
        ("mechanism", MECHANISM_LABELS.get(spec["mechanism"], spec["mechanism"])),
        ("sampling", SAMPLING_LABELS.get(spec.get("sampling") or "", str(spec.get("sampling")))),
        (
            "neighbouring relation",
            RELATION_LABELS.get(spec["neighboring_relation"], spec["neighboring_relation"]),
        ),
        ("accountant", ACCOUNTANT_LABELS.get(spec["accountant"], spec["accountant"])),
        ("convention", convention_text(spec)),
    ]
    release = accounting_spec.release_of(spec["mechanism"])
    if release is not None and release.noise is accounting_spec.Noise.TREE:
        rows.append(("tree restarted every epoch", "yes" if spec["restart_every_epoch"] else "no"))
        if spec.get("min_separation") is not None:
            rows.append(
                ("minimum separation", f"{int(spec['min_separation'])} rounds between uses")
            )
    rows.extend(shared_negatives_rows(ledger))
    return rows


def shared_negatives_rows(ledger: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The DPLC releases of shared negatives (issue 22), whose cost the ledger's epsilon
    already includes; none for a ledger without them."""
    plan = ledger.get("shared_negatives")
    if not plan:
        return []
    from tff_algorithms.privacy import dplc_releases

    plan = dplc_releases.ReleasePlan.from_dict(plan)
    rounds = len(ledger.get("history") or [])
    releases = plan.releases_after(rounds)
    alone = dplc_releases.releases_epsilon(plan, rounds, float(ledger["spec"]["delta"]))
    return [
        (
            "shared negatives (DPLC releases, in ε above)",
            f"{releases} release(s) of {plan.num_clusters} noisy cluster center(s) every "
            f"{plan.every_rounds} round(s), noise multiplier {plan.noise_multiplier:g}, "
            f"{plan.pool_users} sampled users a release, no sampling amplification; "
            f"ε of the releases alone {format_epsilon(alone)}",
        )
    ]


# participation.json (beam_jobs.partition) keys -> (label, unit).
SCHEDULE_LABELS = {
    "users": ("training users", "users"),
    "sampling_units": ("sampling units (users or user groups drawn)", "units"),
    "units_per_round": ("sampling units per round", "units"),
    "users_per_round": ("users per round", "users"),
    "users_per_virtual_client": ("users per virtual client", "users"),
    "virtual_clients_per_round": ("virtual clients per round", "virtual clients"),
    "rounds": ("rounds", "rounds"),
    "rounds_per_epoch": ("rounds per epoch (every user once)", "rounds"),
    "max_participations": ("most rounds one user can take part in", "rounds"),
    "min_separation": ("fewest rounds between two participations of one user", "rounds"),
    "unscheduled_users": ("users never scheduled", "users"),
    "mode": ("schedule", ""),
}


def schedule_rows(schedule: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows = []
    ordered = [key for key in SCHEDULE_LABELS if key in schedule]
    ordered += sorted(key for key in schedule if key not in SCHEDULE_LABELS)
    for key in ordered:
        label, unit = SCHEDULE_LABELS.get(key, (key.replace("_", " "), ""))
        value = schedule[key]
        if isinstance(value, int) and not isinstance(value, bool):
            text = f"{value:,}" + (f" {unit}" if unit else "")
        else:
            text = str(value)
            if key == "mode":
                text = {
                    "sampled": "users sampled at random each round",
                    "epoch": "each user once per epoch",
                    "fixed": "fixed virtual clients (whole groups of k users)",
                }.get(text, text)
        rows.append((label, text))
    return rows
