"""Empirical privacy audit (issue 8 item 7): one-run ε lower bounds next to the ledger's ε.

`tff_algorithms.jobs.audit.run_canary_audit` on a population of canary slots (each holds
its canary with probability 1/2, else a filler user), trained with
`audit.audit_train_config` (every user in one virtual client, every round), at no
noise and at noise multipliers calibrated to a few target ε. The bound is taken at
95% confidence with a fixed number of guesses per side, chosen before the runs (the
bound would not be valid if the best of several were picked afterwards).
"""

from __future__ import annotations

import os
import shutil

from beam_jobs import canaries
from tff_algorithms.federated import runtime
from tff_algorithms.jobs import audit
from tff_algorithms.privacy import accounting_spec, calibration

_FULL = {"canaries": 128, "guesses_per_side": 16, "target_epsilons": (8.0, 4.0, 2.0)}
_QUICK = {"canaries": 32, "guesses_per_side": 8, "target_epsilons": (4.0,)}


def run(out_dir: str, quick: bool) -> dict:
    sizes = _QUICK if quick else _FULL
    population = canaries.CanaryPopulation(
        canaries=sizes["canaries"], images_per_identity=8, membership_seed=1
    )
    work = os.path.join(out_dir, "bench_privacy_audit_work")
    shutil.rmtree(work, ignore_errors=True)
    plain = audit.audit_train_config(population, 0.0, noise_seed=0)
    spec = accounting_spec.AccountingSpec(
        population.canaries,
        population.canaries,
        plain.rounds,
        0.0,
        plain.delta,
        users_per_virtual_client=plain.users_per_virtual_client,
    )
    noise_multipliers = [0.0] + [
        calibration.calibrate_noise_multiplier(spec, target) for target in sizes["target_epsilons"]
    ]
    runs = []
    with runtime.session(handle_signals=False):
        for noise in noise_multipliers:
            config = audit.audit_train_config(population, noise, noise_seed=0)
            result = audit.run_canary_audit(
                population, config, os.path.join(work, f"z={noise:.4g}"), sizes["guesses_per_side"]
            )
            runs.append(result.to_dict())
            print(f"bench_privacy_audit: {runs[-1]}", flush=True)
    return {
        "quick": quick,
        "population": {
            "canaries": population.canaries,
            "images_per_identity": population.images_per_identity,
            "held_out_identities": population.held_out_identities,
        },
        "training": {
            "rounds": plain.rounds,
            "users_per_virtual_client": plain.users_per_virtual_client,
            "virtual_clients_per_round": plain.virtual_clients_per_round,
            "local_epochs": plain.local_epochs,
            "clip_norm": plain.clip_norm,
        },
        "runs": runs,
    }
