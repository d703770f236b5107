"""What the training loop decides for every algorithm: when held-out evaluation runs,
and where the noise seed comes from.

Imported by the training loop (`jobs/loop.py`) and by the algorithms whose noise seed
lives in their own state (the federated aggregators, FDML's server), which draw it with
`job_noise_seed`. No TensorFlow.
"""

from __future__ import annotations

import secrets

NOISE_SEED_BITS = 62


def evaluation_due(rounds: int, evaluate_every: int, done: int) -> bool:
    """Whether held-out evaluation follows round (or step) `done` of `rounds`: after the
    last, and every `evaluate_every` (0: after the last only)."""
    return done == rounds or bool(evaluate_every and done % evaluate_every == 0)


def fresh_noise_seed() -> int:
    """A noise seed from OS entropy, for production runs."""
    return secrets.randbits(NOISE_SEED_BITS)


def job_noise_seed(noise_seed: int | None) -> int:
    """The noise seed a job starts with: its fixed seed (allowed only behind
    `testing_fixed_noise`, `job_config`) or fresh OS entropy. Drawn once per job start;
    the loop or the algorithm's state keeps it in the checkpoint, so a resumed job redraws
    the same noise."""
    return noise_seed if noise_seed is not None else fresh_noise_seed()
