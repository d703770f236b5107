"""FDML benchmark (issue 27, item 4): federated metric learning against DP-FedEmb at equal
strict user-level ε, the paper's privacy figure beside the strict one, its robustness
strategies, and the server step's time against participants (the paper's Table V).

Same users and start as `bench_training`: 1,000 synthetic photo identities × 4 images
(seed 0), 20% of identities held out, 800 training users of one identity each; the small
CNN pretrained without privacy on 300 × 10 public sketches; the convolutions and GroupNorm
layers trained; δ 1e-5; fixed testing schedule and noise seeds (every row draws the same
users, images and noise stream). Rows:

- public-pretrained start.
- triplet oracle: centralized triplet training, no clipping, no noise: each round one
  batch-all triplet loss over all n × s images of the round (one group) and Adam on its
  gradient. It runs as an fdml job with one group of n users and clips of 1e6: a noiseless
  FDML round with r = 0 and rate_p = 1 is the centralized triplet gradient on the same
  examples (tests/tff_algorithms/algorithms/fdml/test_fdml.py), so this is centralized training on the same batches.
- fdml z=0: the product's FDML (groups of g users, derivative rows clipped to C_r,
  gradients to C_g) without noise.
- dp-fedemb@eps=ε and fdml@eps=ε for each ε in EPSILONS: the noise multiplier calibrated
  by the product (`target_epsilon`, `TrainJobConfig.calibrated_for`) to the strict
  user-level ε of each algorithm's own schedule. DP-FedEmb is bench_training's default
  recipe (20 rounds, 12 virtual clients of 8 users); FDML runs FDML_ROUNDS rounds of
  groups × g users, s images each.
- fdml paper eps: the paper's Alg. 2 noise at its ε (Theorem V.1, per sample and per
  round, NOT user-level; TouchAuth's ε 8, r 0.2): derivative noise of the Laplace scale b
  that Theorem V.1 gives for the bound T = C_r (as a Gaussian of the same std, √2 b, the
  only noise the product's process adds), embeddings dropped at rate r, gradients neither
  clipped nor noised (the paper adds no noise there). Its strict user-level ε is ∞ (the
  aggregate is released without noise); the user-level ε of its derivative releases alone
  is given beside it.
- rate_p 1 / 0.8 / 0.6 at the strict ε ROBUSTNESS_EPSILON (Alg. 3: the first rate_p·n
  gradients that arrive are aggregated), and Case B failures at rate CASE_B_RATE under
  UC (continue with the gradients that arrive) and AS (abandon the round). These run
  `fdml_run.run_fdml` on the job's process, users, images and seeds (rate_p 1 without
  failures is the fdml@eps job row itself).
- server step: Alg. 1's batch-all derivatives, row clip and noise (`triplet`, `fdml`) over
  a buffer of n participants × 8 rows × 128 dimensions on this machine's CPU, for the
  paper's n = 64 ... 512, with one group (the paper's buffer) and with groups of g.

Clips: C_r and C_g are near the median derivative-row and participant-gradient norms of
a noiseless round on the *public* sketches from the pretrained start (0.04 and 0.07 at
g = 8, s = 4; the product's default C_r = 1 would be 25 times the rows' norm, and the
noise scales with it). Utility: exact recall@FAR on the held-out identities, 95% bootstrap
intervals over identities with every model scored on the same resamples (paired
differences against each row's reference row), and the FDML paper's authentication
accuracy at the EER threshold (Alg. 4, `fdml_training.eer_summary`; 4 images per held-out
identity allow a 2/1/1 split instead of the paper's 20/10/10).

usage: python -m bench.run_all --only bench_fdml [--quick]; the plot
bench_fdml_recall.png (recall@FAR 0.01 against ε) is written next to the JSON.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
import types
from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from beam_jobs import partition
from bench import bench_contrastive, bench_training
from tff_algorithms.algorithms.fdml import privacy as fdml_privacy
from tff_algorithms.algorithms.fdml import protocol as fdml
from tff_algorithms.algorithms.fdml import round_config, triplet
from tff_algorithms.algorithms.fdml import run as fdml_run
from tff_algorithms.algorithms.fdml import training as fdml_training
from tff_algorithms.config import job_config
from tff_algorithms.evaluation import scoring as evaluation
from tff_algorithms.federated import runtime
from tff_algorithms.jobs import job_outputs
from tff_algorithms.modeling import models

EPSILONS = (2.0, 4.0, 8.0)
ROBUSTNESS_EPSILON = 8.0
RATES_P = (1.0, 0.8, 0.6)
CASE_B_RATE = 0.2  # Table II's lowest exception probability
PAPER_EPSILON = 8.0  # TouchAuth, Table III
PAPER_DROP_RATE = 0.2
PAPER_TABLE_V = {64: 0.48, 128: 2.19, 256: 11.07, 512: 63.65}  # seconds, in SGX
FARS = bench_contrastive.FARS

FULL = {
    **bench_training.FULL,
    "fdml": {
        "users_per_virtual_client": 8,  # g
        "virtual_clients_per_round": 8,  # groups: n = 64, the paper's num_required
        "settings": {"samples_per_user": 4, "derivative_clip": 0.05},  # s: a user's images
        "rounds": 10,
        "server_learning_rate": 1e-3,
        "clip_norm": 0.1,
    },
    "epsilons": EPSILONS,
    "rates_p": RATES_P,
    "bootstrap": 300,
    "server_step": {"participants": (64, 128, 256, 512), "samples": 8, "repeats": 3},
}
QUICK = {
    **bench_training.QUICK,
    "rounds": 1,  # DP-FedEmb's
    "fdml": {
        "users_per_virtual_client": 4,
        "virtual_clients_per_round": 2,
        "settings": {"samples_per_user": 4, "derivative_clip": 0.05},
        "rounds": 1,
        "server_learning_rate": 1e-3,
        "clip_norm": 0.1,
    },
    "epsilons": (ROBUSTNESS_EPSILON,),
    "rates_p": (1.0, 0.6),
    "bootstrap": 50,
    "server_step": {"participants": (8, 16), "samples": 8, "repeats": 1},
}

START = "public-pretrained start"
ORACLE = "triplet oracle (non-private)"
NOISELESS = f"{job_config.FDML} z=0"
PAPER = f"{job_config.FDML} paper eps={PAPER_EPSILON:g} (not user-level)"


def _at(algorithm: str, epsilon: float) -> str:
    return f"{algorithm}@eps={epsilon:g}"


def fdml_base(sizes: Mapping) -> job_config.TrainJobConfig:
    """bench_training's job (seeds, δ, trained layers) as an fdml job at the bench's size."""
    return dataclasses.replace(
        bench_training.base_config(sizes), algorithm=job_config.FDML, **sizes["fdml"]
    )


def _job_row(config: job_config.TrainJobConfig, result: job_outputs.TrainJobResult) -> dict:
    return {
        "saved_model": result.saved_model_dir,
        "noise_multiplier": result.metrics["noise_multiplier_source"]["noise_multiplier"],
        "epsilon": result.metrics["epsilon"],
        "user_level": True,
        "rounds": result.metrics["rounds"],
        "seconds": result.metrics["wall_seconds"],
    }


def paper_noise(row_clip: float, epsilon: float, drop_rate: float) -> dict[str, float]:
    """The Laplace scale b with which Theorem V.1 gives `epsilon` for T = `row_clip` and
    drop rate r, and the Gaussian multiplier of the same std (√2 b / C_r)."""
    b = 2 * row_clip / math.log((math.exp(epsilon) - drop_rate) / (1 - drop_rate))
    paper_epsilon = fdml_privacy.paper_theorem_v1_epsilon(drop_rate, row_clip, b)
    assert math.isclose(paper_epsilon, epsilon, rel_tol=1e-9), paper_epsilon
    return {"laplace_scale": b, "derivative_noise_multiplier": math.sqrt(2) * b / row_clip}


def derivative_release_epsilon(spec: fdml_privacy.FdmlPrivacySpec, delta: float) -> float:
    """User-level ε of a run's derivative releases (R1) alone: every round charged as a
    round abandoned after the derivatives were sent (`fdml_privacy.abandoned_round_event`);
    the gradient multiplier, which R1 does not use, is set to 1 to pass the no-noise check."""
    r1_only = dataclasses.replace(
        spec,
        rounds=0,
        abandoned_rounds=spec.rounds + spec.abandoned_rounds,
        gradient_noise_multiplier=1.0,
    )
    return fdml_privacy.compute_epsilon(r1_only, delta)


class DirectRuns:
    """`fdml_run.run_fdml` on a job's users, images, process and seeds (module docstring)."""

    def __init__(self, config: job_config.TrainJobConfig, data: tuple[str, str], pretrained: str):
        reader = partition.PartitionReader(data[0])
        self.config = config
        self.users = fdml_training.eligible_users(
            reader, reader.user_ids(), config.settings.samples_per_user
        )
        # The job's draw of each user's images (`fdml_training`), from the same seed.
        job_inputs = types.SimpleNamespace(reader=reader, user_ids=self.users, config=config)
        self.samples = fdml_training._UserSamples(job_inputs, config.schedule_seed)
        self.pretrained = models.backbone_weights(
            models.load_pretrained_backbone(config.backbone_config, pretrained)
        )
        self.evaluator = evaluation.HeldOutEvaluator(config.backbone_config, data[1])

    def process_config(self, noise_multiplier: float, **changes) -> round_config.FdmlConfig:
        config = dataclasses.replace(self.config, noise_multiplier=noise_multiplier)
        return dataclasses.replace(
            fdml_training.fdml_config(config, self.config.noise_seed), **changes
        )

    def run(self, name: str, process_config: round_config.FdmlConfig, case_b_rate: float = 0.0):
        """(row, held-out embeddings) of `config.rounds` rounds of `process_config`."""
        began = time.perf_counter()
        process = fdml.build_fdml_process(
            self.config.backbone_config,
            process_config,
            backbone_seed=self.config.seed,
            initial_weights=self.pretrained,
        )
        with runtime.session(handle_signals=False):
            run = fdml_run.run_fdml(
                process,
                process.initialize(),
                self.samples,
                population=len(self.users),
                rounds=self.config.rounds,
                delta=self.config.delta,
                seed=self.config.schedule_seed,
                over_selection=float(self.config.over_selection),
                case_b_rate=case_b_rate,
            )
        row = {
            "epsilon": run.epsilon,
            "rounds": self.config.rounds,
            "applied_rounds": run.applied_rounds,
            "abandoned_rounds": run.abandoned_rounds,
            "case_b_failures": int(sum(h["case_b_failures"] for h in run.history)),
            "aggregated_gradients": int(sum(h.get("aggregated", 0) for h in run.history)),
            "response_rate": process_config.response_rate,
            "case_b_strategy": process_config.case_b_strategy,
            "case_b_rate": case_b_rate,
            "seconds": time.perf_counter() - began,
        }
        print(f"bench_fdml: {name}: {row}", flush=True)
        return row, run, self.evaluator.embeddings(fdml.backbone_weights(run.state))


def server_step_seconds(
    participants: int, samples: int, users_per_group: int, repeats: int, dim: int = 128
) -> dict[str, float]:
    """Median wall and CPU seconds of Alg. 1's batch-all derivatives, row clip and noise
    over a buffer of `participants` × `samples` random unit rows (one identity each)."""
    rng = np.random.default_rng(0)
    embeddings = rng.normal(size=(participants, samples, dim)).astype(np.float32)
    embeddings /= np.linalg.norm(embeddings, axis=-1, keepdims=True)
    keys = tf.constant(np.repeat(np.arange(participants), samples).reshape(participants, samples))
    valid = tf.ones([participants, samples], tf.bool)
    seed = tf.constant([0, 0], tf.int64)

    # Without autograph (nothing here branches on tensors): autograph re-reads the source
    # files, which must then not change while a benchmark runs.
    @tf.function(autograph=False)
    def step(e: tf.Tensor) -> tf.Tensor:
        derivatives, _ = triplet.buffer_derivatives(
            e, keys, valid, users_per_group, triplet.BATCH_ALL, 0.2
        )
        return fdml.privatize_derivatives(derivatives, 1.0, 1.0, seed)

    step(tf.constant(embeddings)).numpy()  # trace
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        step(tf.constant(embeddings)).numpy()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"wall_seconds": float(np.median(walls)), "cpu_seconds": float(np.median(cpus))}


def server_step_table(sizes: Mapping, users_per_group: int) -> list[dict]:
    setting = sizes["server_step"]
    rows = []
    for n in setting["participants"]:
        row = {
            "participants": n,
            "rows": n * setting["samples"],
            "one_group": server_step_seconds(n, setting["samples"], n, setting["repeats"]),
            f"groups_of_{users_per_group}": server_step_seconds(
                n, setting["samples"], users_per_group, setting["repeats"]
            ),
            "paper_sgx_seconds": PAPER_TABLE_V.get(n),
        }
        print(f"bench_fdml: server step: {row}", flush=True)
        rows.append(row)
    return rows


def write_recall_plot(result: Mapping, path: str) -> None:
    """recall@FAR 0.01 against strict user-level ε with 95% intervals, both algorithms."""
    figure, (ax,) = bench_contrastive._axes_grid(1)
    figure.set_size_inches(6.5, 4.5)
    epsilons = result["epsilons"]
    recall = result["recall"]
    # The two series slightly apart along ε, so that their intervals stay readable.
    for algorithm, marker, shift in (
        (job_config.DP_FEDEMB, "s", 0.97),
        (job_config.FDML, "o", 1.03),
    ):
        cells = [recall[_at(algorithm, e)]["0.01"] for e in epsilons]
        values = np.array([c["recall"] for c in cells])
        low = values - np.array([c["interval95"][0] for c in cells])
        high = np.array([c["interval95"][1] for c in cells]) - values
        x = [e * shift for e in epsilons]
        ax.errorbar(x, values, yerr=[low, high], marker=marker, capsize=3, label=algorithm)
    for reference, style in ((ORACLE, "-"), (NOISELESS, "--"), (START, ":")):
        cell = recall[reference]["0.01"]
        ax.axhline(cell["recall"], color="grey", linestyle=style, label=reference)
        ax.axhspan(*cell["interval95"], color="grey", alpha=0.08)
    paper = recall[PAPER]["0.01"]["recall"]
    ax.plot([], [], " ", label=f"{PAPER}: {paper:.3f} (strict ε ∞)")
    ax.set_xlabel("strict user-level ε (substitute-one, δ = 1e-5)")
    ax.set_ylabel("recall@FAR 0.01 (held-out identities)")
    ax.set_title("FDML vs DP-FedEmb at equal strict ε")
    ax.set_xticks(list(epsilons))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, format="png")


def run(out_dir: str, quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    epsilons = sizes["epsilons"]
    work = os.path.join(out_dir, "bench_fdml_work")
    shutil.rmtree(work, ignore_errors=True)
    # First: the cheap part, before the training rows.
    server_step = server_step_table(sizes, sizes["fdml"]["users_per_virtual_client"])
    began = time.perf_counter()
    data, _, pretrained = bench_training.prepare(work, sizes)
    base = fdml_base(sizes)
    n = base.users_per_virtual_client * base.virtual_clients_per_round
    configs = {
        ORACLE: dataclasses.replace(
            base,
            users_per_virtual_client=n,
            virtual_clients_per_round=1,
            settings=dataclasses.replace(base.settings, derivative_clip=1e6),
            clip_norm=1e6,
            noise_multiplier=0.0,
        ),
        NOISELESS: dataclasses.replace(base, noise_multiplier=0.0),
    }
    fedemb = bench_training.base_config(sizes)
    for epsilon in epsilons:
        for algorithm, config in ((job_config.DP_FEDEMB, fedemb), (job_config.FDML, base)):
            configs[_at(algorithm, epsilon)] = dataclasses.replace(
                config, noise_multiplier=None, target_epsilon=epsilon
            )
    rows = {
        START: {"epsilon": 0.0, "user_level": True},
        **bench_training.train_each(
            "bench_fdml", configs, data, work, _job_row, pretrained.saved_model_dir
        ),
    }
    labels, start = evaluation.embed_saved_model(pretrained.saved_model_dir, data[1])
    embeddings = {START: start}
    for name in configs:
        if "saved_model" in rows[name]:
            _, embeddings[name] = evaluation.embed_saved_model(rows[name]["saved_model"], data[1])

    direct = DirectRuns(base, data, pretrained.saved_model_dir)
    assert np.array_equal(direct.evaluator.labels, labels)
    # The paper's ε (Theorem V.1), not user-level.
    noise = paper_noise(base.settings.derivative_clip, PAPER_EPSILON, PAPER_DROP_RATE)
    paper_config = direct.process_config(
        0.0,
        derivative_noise_multiplier=noise["derivative_noise_multiplier"],
        gradient_clip=None,
        embedding_drop_rate=PAPER_DROP_RATE,
    )
    row, paper_run, embeddings[PAPER] = direct.run(PAPER, paper_config)
    rows[PAPER] = {
        **row,
        "user_level": False,
        "paper_epsilon": PAPER_EPSILON,
        "paper_label": fdml_privacy.PAPER_THEOREM_V1_LABEL,
        "embedding_drop_rate": PAPER_DROP_RATE,
        **noise,
        "derivative_releases_user_level_epsilon": derivative_release_epsilon(
            paper_run.spec, base.delta
        ),
    }
    # Robustness at the strict ε: the fdml job's calibrated z.
    reference = _at(job_config.FDML, ROBUSTNESS_EPSILON)
    z = rows[reference]["noise_multiplier"]
    robustness = {}
    for rate_p in sizes["rates_p"][1:]:
        name = f"{reference} rate_p={rate_p:g}"
        robustness[name] = (direct.process_config(z, response_rate=rate_p), 0.0)
    for strategy in (round_config.UC, round_config.AS):
        name = f"{reference} case B {CASE_B_RATE:g} {strategy.upper()}"
        robustness[name] = (direct.process_config(z, case_b_strategy=strategy), CASE_B_RATE)
    for name, (process_config, case_b_rate) in robustness.items():
        row, _, embeddings[name] = direct.run(name, process_config, case_b_rate)
        rows[name] = {**row, "user_level": True, "noise_multiplier": z}
    training_seconds = time.perf_counter() - began

    table, samples = bench_contrastive._recall_table(embeddings, labels, sizes["bootstrap"])
    references = {ORACLE: START, NOISELESS: ORACLE, PAPER: reference}
    for epsilon in epsilons:
        references[_at(job_config.DP_FEDEMB, epsilon)] = START
        references[_at(job_config.FDML, epsilon)] = _at(job_config.DP_FEDEMB, epsilon)
    for name in robustness:
        references[name] = reference
    references[f"{reference} case B {CASE_B_RATE:g} AS"] = f"{reference} case B {CASE_B_RATE:g} UC"
    paired = {
        name: {
            "reference": ref,
            "difference": bench_contrastive._paired(samples, name, ref),
            "vs_start": bench_contrastive._paired(samples, name, START),
        }
        for name, ref in references.items()
        if name in samples and ref in samples
    }
    eer_accuracy = {
        name: fdml_training.eer_summary(values, labels, base.seed)
        for name, values in embeddings.items()
    }
    for row in rows.values():
        row.pop("saved_model", None)
    result = {
        "quick": quick,
        "setting": "bench_training's data, pretraining and default DP-FedEmb recipe",
        "delta": base.delta,
        "epsilons": list(epsilons),
        "fdml": {
            **sizes["fdml"],
            "participants_per_round": n,
            "triplet_strategy": base.settings.triplet_strategy,
            "triplet_margin": base.settings.triplet_margin,
            "derivative_noise_share": base.settings.derivative_noise_share,
            "training_users": len(direct.users),
        },
        "dp_fedemb": {
            "rounds": fedemb.rounds,
            "virtual_clients_per_round": fedemb.virtual_clients_per_round,
            "users_per_virtual_client": fedemb.users_per_virtual_client,
            "clip_norm": fedemb.clip_norm,
        },
        "rows": rows,
        "recall": table,
        "paired_differences": paired,
        "eer_accuracy": eer_accuracy,
        "training_seconds": training_seconds,
        "server_step": server_step,
    }
    os.makedirs(out_dir, exist_ok=True)
    plot = os.path.join(out_dir, "bench_fdml_recall.png")
    write_recall_plot(result, plot)
    result["plot"] = os.path.basename(plot)
    return result
