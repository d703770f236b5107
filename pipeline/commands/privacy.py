"""Compute the user-level (epsilon, delta) of a training schedule, or calibrate its noise.

`dp-fedemb privacy --users N --users-per-round M --noise-multiplier Z --rounds T --delta D`
prints epsilon; `--target-epsilon E` instead of `--noise-multiplier` prints the smallest
noise multiplier that reaches E. With `--json`, one JSON object on stdout (`epsilon`,
`delta`, `zcdp_rho` (null unless dpftrl), the resolved schedule, and for calibration
`target_epsilon`). An infinite epsilon (zero noise) is written as null.

`--mechanism fdml --convention paper` prints the FDML paper's Theorem V.1 instead,
ln[(1 - r) e^{2T/b} + r] from `--embedding-drop-rate`, `--derivative-bound` and
`--laplace-scale`, labelled per sample and per round and `"user_level": false`: a
comparison with the paper only (the budget refuses paper-convention specs).
"""

import enum
import json
from collections.abc import Sequence

from absl import flags

from pipeline.commands import checks
from tff_algorithms import algorithms
from tff_algorithms.privacy import accounting, accounting_spec, calibration


def _values(enum_type: type[enum.Enum]) -> list[str]:
    return [member.value for member in enum_type]


def define_flags(flag_values: flags.FlagValues) -> None:
    flags.DEFINE_integer(
        "users",
        None,
        f"Users in the training population (N), 1 to {accounting_spec.MAX_POPULATION:.0e}.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "users-per-round",
        None,
        "Users taking part in each round (M), 1 to N.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "rounds",
        None,
        f"Training rounds (T), 1 to {accounting_spec.MAX_ROUNDS:.0e}.",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "delta",
        None,
        f"Target delta, in [{accounting_spec.MIN_DELTA:g}, 1).",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "noise-multiplier",
        None,
        "Noise standard deviation over the clip norm of one virtual client's update, 0 to "
        f"{accounting_spec.MAX_NOISE_MULTIPLIER:g}.",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "target-epsilon",
        None,
        "Instead of --noise-multiplier: find the smallest noise multiplier reaching this "
        f"epsilon, in (0, {accounting_spec.MAX_TARGET_EPSILON:g}].",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "mechanism",
        "dpsgd",
        _values(accounting_spec.Mechanism),
        "dpsgd: independent Gaussian noise (DP-FedEmb, DP-FedAvg); "
        "dpftrl: tree-aggregated noise (DP-FTRL-FedEmb); logit_dp: Logit-DP contrastive "
        "steps (--users-per-round users a step, --rounds steps, the noise multiplier "
        "relative to the sensitivity C(n, s, B)); fdml: FDML rounds (--users-per-round "
        "users selected a round, over-selection included; the noise multiplier of "
        "`dp-fedemb train --algorithm fdml`, relative to the round's sensitivities; with "
        "--convention paper the paper's Theorem V.1, per sample and per round, not "
        "user-level: a comparison only).",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "users-per-virtual-client",
        1,
        "Users grouped into one virtual client (K); K > 1 doubles the sensitivity "
        "(halves the effective noise) under add-or-remove relations.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "min-separation",
        None,
        "dpftrl without restart: rounds strictly between two participations of a user "
        "(default: rounds per epoch - 1, what the epoch schedule guarantees).",
        flag_values=flag_values,
    )
    flags.DEFINE_boolean(
        "restart-every-epoch",
        False,
        "dpftrl: restart the tree every epoch.",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "sampling",
        None,
        _values(accounting_spec.Sampling),
        "How users are chosen; default: uniform for dpsgd (the paper's), epoch for dpftrl.",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "neighboring-relation",
        None,
        _values(accounting_spec.NeighboringRelation),
        "Default: replace_one for uniform, add_or_remove_one for poisson, replace_special "
        "for epoch sampling.",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "accountant",
        None,
        _values(accounting_spec.Accountant),
        "Default: pld for uniform sampling under the strict convention (the tight analysis, "
        "docs/privacy.md), rdp otherwise; rdp gives dp_accounting's generic bound.",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "convention",
        "strict",
        _values(accounting_spec.Convention),
        "strict: the noise multiplier is taken relative to the relation's true sensitivity "
        "(2 x clip under substitute-one); paper: the paper's arithmetic (z unchanged under "
        "substitute-one), to reproduce published numbers only: it understates epsilon.",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "embedding-drop-rate",
        0.0,
        "fdml --convention paper only: Theorem V.1's embedding drop rate r, in [0, 1).",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "derivative-bound",
        None,
        "fdml --convention paper only: Theorem V.1's derivative bound T (> 0).",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "laplace-scale",
        None,
        "fdml --convention paper only: Theorem V.1's Laplace noise scale b (> 0).",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "calibration-tolerance",
        calibration.CALIBRATION_RELATIVE_TOLERANCE,
        "With --target-epsilon: the calibrated noise exceeds the exact one by at most this "
        "fraction.",
        flag_values=flag_values,
    )
    flags.DEFINE_boolean(
        "json", False, "Print one JSON object instead of a summary.", flag_values=flag_values
    )
    for name in ("users", "users-per-round", "rounds", "delta"):
        flags.mark_flag_as_required(name, flag_values=flag_values)


def _format_number(value: float | None) -> str:
    if value is None:
        return "-"
    return "infinite" if value == float("inf") else f"{value:.4g}"


def help_defaults() -> dict[str, str]:
    """Effective defaults of the flags that default to None and whose help text does not
    already say it (shown by --help)."""
    return {
        "noise-multiplier": "none: give it or --target-epsilon",
        "target-epsilon": "none: give it or --noise-multiplier",
    }


def check(flag_values: flags.FlagValues, args: Sequence[str]) -> None:
    """The documented bounds (tff_algorithms/privacy/accounting_spec.py, "Bounds"), with one-line flag
    errors; the accountant checks them again, with the combinations."""
    checks.no_arguments(args)
    value = {name: flag_values[name].value for name in flag_values}
    if _paper_theorem(value) is not None:
        _check_paper_theorem(value)
        return
    for name in ("derivative-bound", "laplace-scale"):
        if value[name] is not None:
            stating = " or ".join(sorted(_theorem_mechanisms()))
            raise ValueError(f"--{name} applies only to --mechanism {stating} --convention paper")
    if (value["noise-multiplier"] is None) == (value["target-epsilon"] is None):
        raise ValueError("give exactly one of --noise-multiplier and --target-epsilon")
    checks.number("users", value["users"], 1, accounting_spec.MAX_POPULATION)
    checks.number("users-per-round", value["users-per-round"], 1)
    if value["users-per-round"] > value["users"]:
        raise ValueError(
            f"--users-per-round {value['users-per-round']} exceeds the population "
            f"(--users {value['users']})"
        )
    checks.number("rounds", value["rounds"], 1, accounting_spec.MAX_ROUNDS)
    checks.number("delta", value["delta"], accounting_spec.MIN_DELTA, 1, high_open=True)
    noise = value["noise-multiplier"]
    if noise is not None and noise < 0:
        raise ValueError(f"--noise-multiplier must be non-negative, got {noise:g}")
    checks.number("noise-multiplier", noise, 0, accounting_spec.MAX_NOISE_MULTIPLIER)
    checks.number(
        "target-epsilon",
        value["target-epsilon"],
        0,
        accounting_spec.MAX_TARGET_EPSILON,
        low_open=True,
    )
    checks.number("users-per-virtual-client", value["users-per-virtual-client"], 1)
    checks.number("min-separation", value["min-separation"], 0)
    checks.number("calibration-tolerance", value["calibration-tolerance"], 1e-9, 1, high_open=True)


def _theorem_mechanisms() -> dict[str, algorithms.Algorithm]:
    """The mechanisms whose algorithm's paper states its own figure
    (`Algorithm.paper_theorem`), each with that algorithm."""
    found: dict[str, algorithms.Algorithm] = {}
    for name in algorithms.names(lambda a: a.paper_theorem is not None and a.mechanism):
        algorithm = algorithms.get(name)
        found.setdefault(algorithm.mechanism.value, algorithm)
    return found


def _paper_theorem(value: dict) -> algorithms.Algorithm | None:
    """The algorithm whose paper theorem `--convention paper` prints for `--mechanism`,
    or None: the paper convention is then accounted like any other."""
    if value["convention"] != accounting_spec.Convention.PAPER.value:
        return None
    return _theorem_mechanisms().get(value["mechanism"])


def _check_paper_theorem(value: dict) -> None:
    if value["target-epsilon"] is not None:
        raise ValueError(
            "--target-epsilon calibrates a user-level epsilon: use --convention strict"
        )
    for name in ("derivative-bound", "laplace-scale"):
        if value[name] is None:
            raise ValueError(
                f"--convention paper with --mechanism {value['mechanism']} needs --{name}"
            )
        checks.number(name, value[name], 0, low_open=True)
    checks.number("embedding-drop-rate", value["embedding-drop-rate"], 0, 1, high_open=True)


def _run_paper_theorem(value: dict, algorithm: algorithms.Algorithm) -> int:
    """The paper's theorem as the paper states it (module docstring): never a guarantee."""
    _check_paper_theorem(value)
    epsilon, label = algorithm.load_paper_theorem()(
        value["embedding-drop-rate"], value["derivative-bound"], value["laplace-scale"]
    )
    if value["json"]:
        output = {
            "mechanism": value["mechanism"],
            "convention": accounting_spec.Convention.PAPER.value,
            "epsilon": epsilon,
            "delta": 0.0,
            "zcdp_rho": None,
            "user_level": False,
            "per": "sample and round",
            "analysis": label,
            "embedding_drop_rate": value["embedding-drop-rate"],
            "derivative_bound": value["derivative-bound"],
            "laplace_scale": value["laplace-scale"],
        }
        print(json.dumps(output, allow_nan=False))
        return 0
    print(f"epsilon = {_format_number(epsilon)} PER SAMPLE AND PER ROUND  ({label})")
    print(
        "comparison with the paper only: not composed over rounds or samples, not a "
        "user-level guarantee; --convention strict gives the user-level epsilon"
    )
    return 0


def run(flag_values: flags.FlagValues, args: Sequence[str]) -> int:
    if args:
        raise ValueError(f"unexpected arguments: {' '.join(args)}")
    value = {name: flag_values[name].value for name in flag_values}
    theorem = _paper_theorem(value)
    if theorem is not None:
        return _run_paper_theorem(value, theorem)
    noise = flag_values["noise-multiplier"].value
    target_epsilon = flag_values["target-epsilon"].value
    if (noise is None) == (target_epsilon is None):
        raise ValueError("give exactly one of --noise-multiplier and --target-epsilon")
    spec = accounting_spec.AccountingSpec(
        population=flag_values["users"].value,
        users_per_round=flag_values["users-per-round"].value,
        rounds=flag_values["rounds"].value,
        noise_multiplier=1.0 if noise is None else noise,
        delta=flag_values["delta"].value,
        mechanism=flag_values["mechanism"].value,
        users_per_virtual_client=flag_values["users-per-virtual-client"].value,
        restart_every_epoch=flag_values["restart-every-epoch"].value,
        sampling=flag_values["sampling"].value,
        neighboring_relation=flag_values["neighboring-relation"].value,
        accountant=flag_values["accountant"].value,
        min_separation=flag_values["min-separation"].value,
        convention=flag_values["convention"].value,
    )
    if target_epsilon is not None:
        noise = calibration.calibrate_noise_multiplier(
            spec, target_epsilon, flag_values["calibration-tolerance"].value
        )
        spec = spec.with_noise_multiplier(noise)
    result = accounting.compute_privacy(spec, rdp_cross_check=True)

    if flag_values["json"].value:
        output = {**spec.to_dict(), **result.to_dict()}
        if target_epsilon is not None:
            output["target_epsilon"] = target_epsilon
        print(json.dumps(output, allow_nan=False))
        return 0

    order = f", order {result.rdp_order:g}" if result.rdp_order is not None else ""
    print(
        f"epsilon = {_format_number(result.epsilon)} at delta = {spec.delta:g}  "
        f"({result.analysis}{order})"
    )
    if result.epsilon_rdp is not None:
        print(f"RDP cross-check: epsilon = {_format_number(result.epsilon_rdp)} (--accountant rdp)")
    if result.zcdp_rho is not None:
        print(f"zCDP rho = {_format_number(result.zcdp_rho)}")
    calibrated = f" (calibrated for epsilon {target_epsilon:g})" if target_epsilon else ""
    print(
        f"noise multiplier {spec.noise_multiplier:.6g}{calibrated}, effective "
        f"{result.effective_noise_multiplier:.6g}; {spec.population} users, "
        f"{spec.users_per_round} per round in virtual clients of "
        f"{spec.users_per_virtual_client}, {spec.rounds} rounds"
    )
    return 0
