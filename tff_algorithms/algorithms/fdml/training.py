"""FDML as a training job's algorithm (issue 27, item 3): `train_job.run_train_job` calls
`train_fdml` for `algorithm="fdml"`; the budget charge, export, metrics.json and
ledger.json are the job's, as for the other algorithms.

The job's fields map onto `round_config.FdmlConfig` (`fdml_config`; `job_config.TrainJobConfig`
says which field is which). The round's noise is one number, z = `noise_multiplier`,
relative to the round's sensitivities: the accountant's `accounting_spec.Mechanism.FDML`
charges one sampled Gaussian of multiplier z per round, which is what
`fdml_privacy.compute_epsilon` gives for the derivative and gradient noise derived here
(tests/tff_algorithms/algorithms/fdml/test_fdml_job.py checks the two agree).

Population. Only users holding at least `samples_per_user` images train
(`eligible_users`): the buffer's rows are then all real, and a user who cannot fill its
s rows is never selected (nothing of it is used: its epsilon is 0). The accountant's
population is the eligible users; the cross-run budget is still keyed by every training
user, so runs of other algorithms on the same users compose with this one. Fewer
eligible users than a round selects: one line, before any round
(`fdml_fields.fdml_selected_per_round`).

Rounds. Round t selects users by `fdml_run.round_users(schedule_seed, t, 0, ...)` (the
schedule seed is secret and in OUTPUT/train_job.json, as for the other algorithms);
each user's s images are drawn from (schedule seed, user, round). The job injects no
failures (`failure_injection_rate` is refused for fdml) and continues with every
gradient (UC, rate_p 1), so no round restarts or is abandoned; one that were would
still be charged as a full round by the ledger, an upper bound of its cost
(`fdml_privacy`: an abandoned round costs its derivative release only).

Checkpoints: the training loop's (`jobs/loop.py`). The server state (weights,
Adam state, round counter, noise seed) lives in variables (`checkpoints.StructureState`),
saved with the ledger and the history every `loop.CHECKPOINT_EVERY` rounds and on
evaluation rounds; a re-run resumes from the newest intact checkpoint and redraws the
same users, images and noise, so it ends where an uninterrupted run ends. Checkpoints
of the earlier fdml-<round>.npz format are refused in one line. The server's monitoring
values (`fdml.UNPRIVATE_METRICS`) are never recorded.

Evaluation: recall@FAR on the held-out records, and the FDML paper's authentication
accuracy at the EER threshold (`eer`, Alg. 4) on the same embeddings (`eer_summary`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from beam_jobs import partition
from tff_algorithms.algorithms.fdml import protocol as fdml
from tff_algorithms.algorithms.fdml import round_config
from tff_algorithms.algorithms.fdml import run as fdml_run
from tff_algorithms.algorithms.fdml.fields import fdml_selected_per_round
from tff_algorithms.config import loop_schedule
from tff_algorithms.config.job_config import TrainJobConfig
from tff_algorithms.evaluation import eer, metrics
from tff_algorithms.federated import client_data
from tff_algorithms.jobs import loop
from tff_algorithms.jobs.checkpoints import StructureState
from tff_algorithms.jobs.job_outputs import JobOutcome

if TYPE_CHECKING:
    from tff_algorithms.jobs.job_inputs import JobInputs

# The paper's split of each held-out user's embeddings (section VII-C) and reference users.
PAPER_EER_SPLIT = (20, 10, 10)
PAPER_REFERENCE_USERS = 10
# Stream of the per-round image draws, apart from the users' draw of the same seed.
_SAMPLE_STREAM = 0xFD31


def eligible_users(
    reader: partition.PartitionReader, user_ids: list[str], samples_per_user: int
) -> list[str]:
    """The users holding at least `samples_per_user` images (from the partition's index,
    without reading records), in `user_ids`' order."""
    return [u for u in user_ids if reader.location(u).records >= samples_per_user]


def fdml_config(config: TrainJobConfig, noise_seed: int) -> round_config.FdmlConfig:
    """The process configuration of a job (module docstring; `TrainJobConfig`).

    z is split as 1/z^2 = share/z^2 + (1 - share)/z^2: z_1 = z / sqrt(share) relative to
    the derivatives' sensitivity 2 C_r sqrt(g s), z_2 = z / sqrt(1 - share) relative to
    the gradient sum's 2 C_g (`fdml_privacy`).
    """
    g = config.users_per_virtual_client
    s = config.settings.samples_per_user
    z = float(config.noise_multiplier)
    share = float(config.settings.derivative_noise_share)
    return round_config.FdmlConfig(
        samples_per_user=s,
        users_per_round=g * int(config.virtual_clients_per_round),
        users_per_group=g,
        strategy=config.settings.triplet_strategy,
        margin=float(config.settings.triplet_margin),
        row_clip=float(config.settings.derivative_clip),
        derivative_noise_multiplier=2 * math.sqrt(g * s) * z / math.sqrt(share),
        gradient_clip=float(config.clip_norm),
        gradient_noise_multiplier=2 * z / math.sqrt(1 - share),
        server_learning_rate=float(config.server_learning_rate),
        noise_seed=noise_seed,
    )


def eer_summary(embeddings: np.ndarray, labels: np.ndarray, seed: int) -> dict[str, Any]:
    """The EER authentication accuracy with the paper's split when every held-out identity
    has the 40 images it needs, else with the largest split (template half, threshold and
    test a quarter each) the smallest identity allows; the split used is recorded. None
    values and a reason when the held-out set is too small for any split."""
    counts = np.unique(labels, return_counts=True)[1]
    users = len(counts)
    if counts.min() >= sum(PAPER_EER_SPLIT) and users >= 2 * PAPER_REFERENCE_USERS + 1:
        split, reference = PAPER_EER_SPLIT, PAPER_REFERENCE_USERS
    else:
        quarter = int(counts.min()) // 4
        split = (2 * quarter, quarter, quarter)
        reference = min(PAPER_REFERENCE_USERS, (users - 1) // 2)
    if min(split) < 1 or reference < 1:
        return {
            "accuracy": None,
            "balanced_accuracy": None,
            "reason": f"{users} held-out identities of at least {int(counts.min())} images "
            "are too few for the protocol",
        }
    result = eer.eer_accuracy(
        embeddings,
        labels,
        template=split[0],
        threshold=split[1],
        test=split[2],
        reference_users=reference,
        seed=seed,
    )
    return {
        "accuracy": result.accuracy,
        "balanced_accuracy": result.balanced_accuracy,
        "evaluated_users": result.evaluated_users,
        "split": {"template": split[0], "threshold": split[1], "test": split[2]},
        "reference_users": reference,
        "paper_split": split == PAPER_EER_SPLIT and reference == PAPER_REFERENCE_USERS,
    }


class _UserSamples:
    """Each round's s images of a user: drawn from (schedule seed, user, round), the same
    on every iteration (the replay of the backpropagation iterates them again)."""

    def __init__(self, inputs: JobInputs, schedule_seed: int) -> None:
        self._reader = inputs.reader
        self._user_ids = inputs.user_ids
        self._seed = schedule_seed
        self._s = inputs.config.settings.samples_per_user
        self._shape = inputs.config.image_shape

    def __call__(self, user: int, round_num: int) -> tf.data.Dataset:
        examples = self._reader.user_examples(self._user_ids[user])
        rng = np.random.default_rng([self._seed, _SAMPLE_STREAM, user, round_num])
        chosen = [examples[int(i)] for i in rng.choice(len(examples), self._s, replace=False)]
        return tf.data.Dataset.from_tensor_slices(tf.constant(chosen, tf.string)).map(
            lambda serialized: client_data.parse_example(serialized, self._shape)
        )


def _evaluate(inputs: JobInputs, weights: Any) -> dict[str, Any]:
    embeddings = inputs.evaluator.embeddings(weights)
    labels = inputs.evaluator.labels
    return {
        "recall_at_far": metrics.recall_at_far(
            embeddings, labels, users=inputs.evaluator.pair_users
        ).as_json_dict(),
        "eer_accuracy": eer_summary(embeddings, labels, inputs.config.seed),
    }


def train_fdml(inputs: JobInputs, schedule_seed: int) -> JobOutcome:
    """Trains `config.rounds` FDML rounds (module docstring); needs a TFF runtime."""
    config = inputs.config
    population = len(inputs.user_ids)
    selected = fdml_selected_per_round(config, population)
    process = fdml.build_fdml_process(
        config.backbone_config,
        # Replaced by the checkpoint's on resume: the server state holds it.
        fdml_config(config, loop_schedule.job_noise_seed(config.noise_seed)),
        backbone_seed=config.seed,
        initial_weights=inputs.pretrained,
    )
    server = StructureState(process.initialize())
    samples = _UserSamples(inputs, schedule_seed)

    def round_step(t: int, _: tf.Tensor | None) -> dict[str, Any]:
        users = fdml_run.round_users(schedule_seed, t, 0, population, selected)
        output = process.next(server.get(), [samples(int(u), t) for u in users])
        if output.restarted:  # impossible without failures (module docstring)
            raise RuntimeError(f"round {t + 1} had too few embedding uploads")
        server.set(output.state)
        return {
            # Counts of the data-independent schedule only (fdml.UNPRIVATE_METRICS left out).
            **{k: v for k, v in output.metrics.items() if k not in fdml.UNPRIVATE_METRICS},
            "applied": int(output.applied),
            "abandoned": int(output.abandoned),
        }

    def backbone() -> Any:
        return fdml.backbone_weights(server.get())

    return loop.run(
        inputs,
        loop.Round(
            round_step,
            {"server_state": server.leaves},
            backbone,
            noisy=False,  # the noise seed is in the server state
            evaluate=lambda: _evaluate(inputs, backbone()),
        ),
    )
