"""Private contrastive training benchmark: Logit-DP vs Naive-DP (issue 26, item 5).

Two parts, both with the small CNN (every layer trained) and user-level ε under the strict
substitute-one convention, δ = 1e-5.

Part A, the contrastive stage alone, on two data sets: the built-in synthetic photos
(bench_training's private users: 1,000 identities x 4 images, 20% of identities held out,
one identity per user) and real images shipped by installed packages (bench/real_images.py:
scikit-learn's digit scans and tiles of the photos, MRI slice, elevation model and graphics
of scikit-learn and matplotlib; an identity is one such image, its images are the image and
its re-encoded, resized, cropped, shifted, re-lit copies from `real_images.TRANSFORMS`,
converted to grey; one identity per user, 20% held out). From the same random start
(seed 0) and with the same users and pairs each step, for each ε in EPSILONS:

- Logit-DP: per-pair clipped logit gradients (`logit_dp.clipped_gradient_by_rows`), noise
  σ·C(n, s, B) (`logit_dp_sensitivity.check_logit_dp_config`); σ calibrated with
  `calibration.calibrate_noise_multiplier` on the `logit_dp` accounting spec.
- Naive-DP: the whole batch gradient clipped to B (`logit_dp.naive_dp_clipped_gradient`),
  noise σ'·2B (`logit_dp_sensitivity.naive_dp_sensitivity`). Its accounting is the `dpsgd`
  spec with one user per virtual client: dpsgd's strict sensitivity is 2 clip norms, so a
  dpsgd noise multiplier z is noise std z·B = (z/2)·2B, i.e. σ' = z/2 relative to Naive-DP's
  sensitivity 2B. The calibrated z is converted so; both specs are the same sampled
  Gaussian, so σ' equals Logit-DP's σ up to the calibration tolerance (recorded).
- Non-private: the unclipped gradient of the summed loss, no noise (ε = ∞).

Each step samples n users uniformly without replacement (the sampling the accountant
analyses) and one positive pair (two distinct images) per user; the update is the released
gradient / n with momentum SGD (Logit-DP's recipe: lr 0.05, momentum 0.9, as
`recipes.PRIVATE_CONTRASTIVE` sets for the pipeline). Naive-DP's released gradient has norm
≤ B where Logit-DP's has up to 2nB, so with the same lr it would barely move: its lr is
tuned over lr·{1, n/4, n} on the final held-out loss (a choice made with held-out data, in
Naive-DP's favour). The held-out contrastive loss (fixed batches of n pairs of held-out
identities, divided by its value at the start) is recorded every few steps for the paper's
Figure 1; recall@FAR on held-out identities with paired bootstrap intervals over identities
(`metrics.bootstrap_recall_at_far`, every model of a data set scored on the same resamples).

Part B, the product's question on the synthetic data, through `train_job.run_train_job`:
at one total ε, (1) Logit-DP from scratch (ε·LOGIT_SHARE) then DP-FedEmb from its model,
the DP-FedEmb noise chosen so that the two runs' composed ε
(`budget.composed_epsilon` of both accounting specs) is the total; (2) DP-FedEmb from the
public-pretrained start (bench_training's sketches) at the total alone; (3) DP-FedEmb from
scratch (every layer) at the total alone. DP-FedEmb is bench_training's configuration.

usage: python -m bench.bench_contrastive [--quick] [--results-dir DIR]
(or python -m bench.run_all --only bench_contrastive [--quick]); plots are written next to
the JSON: bench_contrastive_recall.png and bench_contrastive_loss.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf
from PIL import Image

from beam_jobs import partition, synthetic
from bench import bench_training, real_images
from tff_algorithms.algorithms.logit_dp import mechanism as logit_dp
from tff_algorithms.algorithms.logit_dp import sensitivity as logit_dp_sensitivity
from tff_algorithms.config import job_config, job_plan, model_config
from tff_algorithms.evaluation import metrics
from tff_algorithms.evaluation import scoring as evaluation
from tff_algorithms.federated import runtime
from tff_algorithms.jobs import train_job
from tff_algorithms.modeling import models
from tff_algorithms.privacy import accounting, accounting_spec, budget, calibration

EPSILONS = (2.0, 5.0, 8.0)
DELTA = 1e-5
FARS = (1e-3, 1e-2, 1e-1)
HELD_OUT_FRACTION = bench_training.HELD_OUT_FRACTION
# Logit-DP's hyperparameters: the pipeline's private contrastive recipe (n 32, s 1, B 1,
# lr 0.05, momentum 0.9, 40 steps), spelled out so the bench does not move with it.
SCALE = 1.0
CLIP = 1.0
LR = 0.05
MOMENTUM = 0.9
# The composed arm spends this share of the total ε on Logit-DP, the rest on DP-FedEmb.
LOGIT_SHARE = 0.5

FULL = {
    "synthetic_identities": 1000,
    "synthetic_images": 4,
    "real_digits_per_class": 30,
    "real_eval_views": 4,
    "steps": 40,
    "n": 32,
    "loss_every": 4,
    "loss_batches": 6,
    "bootstrap": 500,
    "pipeline": {
        "identities": 1000,
        "images": 4,
        "public_identities": 300,
        "public_images": 10,
        "pretrain_epochs": 12,
        "rounds": 20,
        "virtual_clients_per_round": 12,
        "epochs": 8,
        "logit_steps": 40,
        "n": 32,
        "epsilon": 8.0,
    },
}
QUICK = {
    "synthetic_identities": 150,
    "synthetic_images": 4,
    "real_digits_per_class": 6,
    "real_eval_views": 4,
    "steps": 6,
    # At logit scale 1 the sensitivity stays below n·B only from n = 14 (logit_dp_sensitivity).
    "n": 16,
    "loss_every": 2,
    "loss_batches": 2,
    "bootstrap": 100,
    "pipeline": {
        "identities": 100,
        "images": 4,
        "public_identities": 20,
        "public_images": 4,
        "pretrain_epochs": 3,
        "rounds": 2,
        "virtual_clients_per_round": 4,
        "epochs": 1,
        "logit_steps": 3,
        "n": 16,
        "epsilon": 8.0,
    },
}

LOGIT = "logit-dp"
NAIVE = "naive-dp"
NONPRIVATE = "non-private"


# ---------------------------------------------------------------------------------------
# Data of part A: users' images in memory, held-out images and loss pairs.


@dataclasses.dataclass(frozen=True)
class ContrastiveData:
    name: str
    users: list[np.ndarray]  # per training user: [k >= 2, 28, 28, 1] float32 in [0, 1]
    eval_images: np.ndarray  # [N, 28, 28, 1]
    eval_labels: np.ndarray  # [N] identity index
    loss_pairs: list[tuple[np.ndarray, np.ndarray]]  # fixed held-out batches of n pairs


def _as_input(pixels: np.ndarray) -> np.ndarray:
    return (pixels.astype(np.float32) / 255.0)[..., None]


def _split(
    name: str, identities: list[np.ndarray], n: int, batches: int, eval_views: int
) -> ContrastiveData:
    """Identities (each [k, 28, 28, 1]) in a fixed order: the last HELD_OUT_FRACTION are held out."""
    train_count = int(len(identities) * (1 - HELD_OUT_FRACTION))
    held_out = identities[train_count:]
    eval_images = np.concatenate([views[:eval_views] for views in held_out])
    eval_labels = np.repeat(np.arange(len(held_out)), [min(eval_views, len(v)) for v in held_out])
    # Loss pairs: fixed, from held-out identities only (a loss on training pairs would be
    # both optimistic and an unaccounted release in a product).
    rng = np.random.default_rng(12345)
    loss_pairs = []
    for _ in range(batches):
        chosen = rng.choice(len(held_out), size=n, replace=False)
        firsts, seconds = [], []
        for index in chosen:
            i, j = rng.choice(len(held_out[index]), size=2, replace=False)
            firsts.append(held_out[index][i])
            seconds.append(held_out[index][j])
        loss_pairs.append((np.stack(firsts), np.stack(seconds)))
    return ContrastiveData(
        name, identities[:train_count], eval_images, eval_labels.astype(np.int64), loss_pairs
    )


def synthetic_data(sizes: Mapping) -> ContrastiveData:
    """bench_training's private photo users (seed 0), rendered in memory."""
    config = synthetic.SyntheticConfig(
        identities=sizes["synthetic_identities"], images_per_identity=sizes["synthetic_images"]
    )
    identities = [
        np.stack(
            [
                _as_input(synthetic.render_image(config, i, k))
                for k in range(config.images_per_identity)
            ]
        )
        for i in range(config.identities)
    ]
    return _split(
        "synthetic", identities, sizes["n"], sizes["loss_batches"], sizes["synthetic_images"]
    )


# Real images: an identity is one REGION x REGION square of a real source image, its
# images are crops of it at random positions and sizes (CROP_RANGE, source pixels) with
# jittered brightness and contrast, in grey at 28x28: "which place of which picture",
# like photos of one landmark. (The dedup bench's near-copies of one image would be
# recognised at recall ~0.99 by the random start, leaving nothing to compare.)
REGION = 40
CROP_RANGE = (24, 36)
REAL_VIEWS = 6


def _region_views(region: np.ndarray, rng: np.random.Generator, views: int) -> np.ndarray:
    out = []
    for _ in range(views):
        side = int(rng.integers(CROP_RANGE[0], CROP_RANGE[1] + 1))
        top, left = rng.integers(0, REGION - side + 1, size=2)
        crop = Image.fromarray(region[top : top + side, left : left + side])
        pixels = np.asarray(crop.resize((28, 28), Image.BICUBIC), np.float64)
        pixels = (pixels - pixels.mean()) * rng.uniform(0.7, 1.3) + pixels.mean()
        pixels = np.clip(np.round(pixels + rng.uniform(-20, 20)), 0, 255)
        out.append(_as_input(pixels.astype(np.uint8)))
    return np.stack(out)


def real_regions(views: int = REAL_VIEWS, seed: int = 7) -> list[np.ndarray]:
    """[views, 28, 28, 1] per region with content, regions of every source, shuffled."""
    rng = np.random.default_rng(seed)
    regions = []
    for name, image in real_images.sources().items():
        grey = image @ np.array([0.299, 0.587, 0.114]) if image.ndim == 3 else image * 1.0
        height, width = grey.shape
        for top in range(0, height - REGION + 1, REGION):
            for left in range(0, width - REGION + 1, REGION):
                region = grey[top : top + REGION, left : left + REGION]
                if name == "elevation":  # heights, not grey levels: stretched per region
                    low, high = region.min(), region.max()
                    region = (region - low) * 255 / max(high - low, 1)
                if region.std() < 16.0:  # sky or background: nothing to tell apart
                    continue
                regions.append(np.round(region).astype(np.uint8))
    order = rng.permutation(len(regions))
    return [_region_views(regions[int(i)], rng, views) for i in order]


def real_data(sizes: Mapping) -> ContrastiveData:
    """Real images (module docstring and REGION above), one identity per user."""
    identities = real_regions()
    return _split("real", identities, sizes["n"], sizes["loss_batches"], sizes["real_eval_views"])


def step_batch(data: ContrastiveData, n: int, step: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """n users uniformly without replacement, two distinct images of each: (x, y)."""
    rng = np.random.default_rng([seed, step])
    users = rng.choice(len(data.users), size=n, replace=False)
    xs, ys = [], []
    for user in users:
        i, j = rng.choice(len(data.users[user]), size=2, replace=False)
        xs.append(data.users[user][i])
        ys.append(data.users[user][j])
    return np.stack(xs), np.stack(ys)


# ---------------------------------------------------------------------------------------
# Part A training: one traced step per method, reused across ε (σ·C and lr are variables).


class Trainer:
    """One method's step on one model; `reset` restarts it from the initial weights."""

    def __init__(self, method: str, n: int) -> None:
        self.method, self.n = method, n
        self.model = models.build_backbone(model_config.BackboneConfig(), seed=0)
        self.initial = [v.numpy() for v in self.model.variables]
        self.variables = list(self.model.trainable_variables)
        self.num_parameters = int(sum(np.prod(v.shape) for v in self.variables))
        self.noise_std = tf.Variable(0.0, dtype=tf.float32)
        self.optimizer = tf.keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
        self.optimizer.build(self.variables)
        self._step = tf.function(self._step_fn)
        self._loss = tf.function(self._loss_fn)

    def embed(self, images: tf.Tensor) -> tf.Tensor:
        return self.model(images, training=False)  # per example: no batch statistics

    def _released(self, x: tf.Tensor, y: tf.Tensor, seed: tf.Tensor) -> tuple[list, tf.Tensor]:
        kwargs = {"scale": SCALE, "clip_norm": CLIP}
        if self.method == LOGIT:
            signal = logit_dp.clipped_gradient_by_rows(self.embed, self.variables, x, y, **kwargs)
        elif self.method == NAIVE:
            signal = logit_dp.naive_dp_clipped_gradient(self.embed, self.variables, x, y, **kwargs)
        else:
            with tf.GradientTape() as tape:
                a, b = self.embed(x), self.embed(y)
                loss = logit_dp.contrastive_loss(logit_dp.cosine_logits(a, b, SCALE))
            gradient = tape.gradient(loss, self.variables)
            return gradient, tf.linalg.global_norm(gradient)
        # The library's stateless noise at unit std, scaled by σ·C held in a variable: the
        # same draw as add_gaussian_noise(signal, σ·C, seed), one trace for every ε.
        unit = logit_dp.add_gaussian_noise([tf.zeros_like(g) for g in signal], 1.0, seed)
        released = [g + self.noise_std * z for g, z in zip(signal, unit, strict=True)]
        return released, tf.linalg.global_norm(signal)

    def _step_fn(self, x: tf.Tensor, y: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        released, signal_norm = self._released(x, y, seed)
        self.optimizer.apply_gradients(
            zip([g / self.n for g in released], self.variables, strict=True)
        )
        return signal_norm

    def _loss_fn(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        return logit_dp.contrastive_loss(
            logit_dp.cosine_logits(self.embed(x), self.embed(y), SCALE)
        )

    def reset(self, noise_std: float, learning_rate: float) -> None:
        for variable, value in zip(self.model.variables, self.initial, strict=True):
            variable.assign(value)
        for variable in self.optimizer.variables:
            variable.assign(tf.zeros_like(variable))  # momentum and iteration count
        self.optimizer.learning_rate.assign(learning_rate)
        self.noise_std.assign(noise_std)

    def step(self, x: np.ndarray, y: np.ndarray, seed: Sequence[int]) -> float:
        return float(self._step(tf.constant(x), tf.constant(y), tf.constant(seed, tf.int64)))

    def held_out_loss(self, data: ContrastiveData) -> float:
        """Mean per-pair loss over the fixed held-out batches."""
        values = [float(self._loss(tf.constant(x), tf.constant(y))) for x, y in data.loss_pairs]
        return float(np.mean(values)) / self.n

    def embeddings(self, images: np.ndarray) -> np.ndarray:
        return np.concatenate(
            [
                self.embed(tf.constant(images[i : i + 256])).numpy()
                for i in range(0, len(images), 256)
            ]
        )


def train(trainer: Trainer, data: ContrastiveData, steps: int, loss_every: int, noise_seed: int):
    """Trains from the reset state; returns (held-out loss curve, mean signal norm, seconds)."""
    curve = [(0, trainer.held_out_loss(data))]
    signal_norms = []
    began = time.perf_counter()
    for t in range(steps):
        x, y = step_batch(data, trainer.n, t)
        signal_norms.append(trainer.step(x, y, (noise_seed, t)))
        if (t + 1) % loss_every == 0 or t + 1 == steps:
            curve.append((t + 1, trainer.held_out_loss(data)))
    return curve, float(np.mean(signal_norms)), time.perf_counter() - began


def calibrated_noise(population: int, n: int, steps: int, epsilon: float) -> dict[str, float]:
    """σ of Logit-DP (logit_dp spec) and σ' of Naive-DP (dpsgd spec, z/2) for `epsilon`."""
    common = {"population": population, "users_per_round": n, "rounds": steps, "delta": DELTA}
    logit_spec = accounting_spec.AccountingSpec(
        noise_multiplier=1.0, mechanism=accounting_spec.Mechanism.LOGIT_DP, **common
    )
    dpsgd_spec = accounting_spec.AccountingSpec(
        noise_multiplier=1.0,
        mechanism=accounting_spec.Mechanism.DPSGD,
        users_per_virtual_client=1,
        **common,
    )
    sigma = calibration.calibrate_noise_multiplier(logit_spec, epsilon)
    z = calibration.calibrate_noise_multiplier(dpsgd_spec, epsilon)
    return {
        "logit_sigma": sigma,
        "logit_epsilon": accounting.compute_privacy(
            logit_spec.with_noise_multiplier(sigma)
        ).epsilon,
        "dpsgd_z": z,
        "naive_sigma": z / 2.0,
        "naive_epsilon": accounting.compute_privacy(dpsgd_spec.with_noise_multiplier(z)).epsilon,
    }


def _recall_table(
    embeddings: Mapping[str, np.ndarray], labels: np.ndarray, resamples: int
) -> tuple[dict[str, dict], dict[str, np.ndarray]]:
    """Per model: exact recall@FAR and 95% bootstrap intervals; and the raw resamples."""
    samples = metrics.bootstrap_recall_at_far(embeddings, labels, FARS, resamples, seed=0)
    table = {}
    for name, values in embeddings.items():
        exact = metrics.recall_at_far(values, labels, FARS)
        table[name] = {
            format(far, "g"): {
                "recall": exact.recall[far],
                "interval95": metrics.percentile_interval(samples[name][:, f]),
            }
            for f, far in enumerate(FARS)
        }
    return table, samples


def _paired(samples: Mapping[str, np.ndarray], a: str, b: str) -> dict[str, dict]:
    """recall(a) − recall(b) on the same resamples: mean and 95% interval per FAR."""
    diff = samples[a] - samples[b]
    return {
        format(far, "g"): {
            "mean": float(np.nanmean(diff[:, f])),
            "interval95": metrics.percentile_interval(diff[:, f]),
        }
        for f, far in enumerate(FARS)
    }


def part_a(data: ContrastiveData, sizes: Mapping, trainers: Mapping[str, Trainer]) -> dict:
    n, steps = sizes["n"], sizes["steps"]
    population = len(data.users)
    sensitivity = logit_dp_sensitivity.check_logit_dp_config(n, SCALE, CLIP)
    naive_sensitivity = logit_dp_sensitivity.naive_dp_sensitivity(CLIP)
    parameters = trainers[LOGIT].num_parameters
    embeddings = {"random start": trainers[LOGIT].embeddings(data.eval_images)}
    runs: dict[str, dict] = {}

    def run(name: str, trainer: Trainer, noise_std: float, lr: float, noise_seed: int) -> dict:
        trainer.reset(noise_std, lr)
        curve, signal, seconds = train(trainer, data, steps, sizes["loss_every"], noise_seed)
        record = {
            "learning_rate": lr,
            "noise_std": noise_std,
            # Per-step norms, before /n: the noise vector's expected norm against the
            # clipped signal's measured mean norm.
            "noise_norm": noise_std * math.sqrt(parameters),
            "signal_norm": signal,
            "held_out_loss": curve,
            "relative_loss": [(t, value / curve[0][1]) for t, value in curve],
            "seconds": seconds,
        }
        print(
            f"bench_contrastive: {data.name} {name}: final relative loss "
            f"{record['relative_loss'][-1][1]:.3f}, {seconds:.0f} s",
            flush=True,
        )
        return record, trainer.embeddings(data.eval_images)

    record, embeddings[NONPRIVATE] = run(NONPRIVATE, trainers[NONPRIVATE], 0.0, LR, 0)
    runs[NONPRIVATE] = {**record, "epsilon": None}
    noise: dict[str, dict] = {}
    for epsilon in EPSILONS:
        calibrated = calibrated_noise(population, n, steps, epsilon)
        noise[f"{epsilon:g}"] = calibrated
        name = f"{LOGIT}@eps={epsilon:g}"
        record, embeddings[name] = run(
            name, trainers[LOGIT], calibrated["logit_sigma"] * sensitivity, LR, 1
        )
        runs[name] = {
            **record,
            "epsilon": calibrated["logit_epsilon"],
            "sigma": calibrated["logit_sigma"],
        }
        best = None
        for factor in (1.0, n / 4, float(n)):
            candidate = run(
                f"{NAIVE}@eps={epsilon:g} lr x{factor:g}",
                trainers[NAIVE],
                calibrated["naive_sigma"] * naive_sensitivity,
                LR * factor,
                1,
            )
            if (
                best is None
                or candidate[0]["held_out_loss"][-1][1] < best[0]["held_out_loss"][-1][1]
            ):
                best = candidate
        name = f"{NAIVE}@eps={epsilon:g}"
        record, embeddings[name] = best
        runs[name] = {
            **record,
            "epsilon": calibrated["naive_epsilon"],
            "sigma": calibrated["naive_sigma"],
        }

    table, samples = _recall_table(embeddings, data.eval_labels, sizes["bootstrap"])
    paired = {}
    for epsilon in EPSILONS:
        logit, naive = f"{LOGIT}@eps={epsilon:g}", f"{NAIVE}@eps={epsilon:g}"
        paired[f"{logit} - {naive}"] = _paired(samples, logit, naive)
        paired[f"{logit} - random start"] = _paired(samples, logit, "random start")
    paired[f"{NONPRIVATE} - random start"] = _paired(samples, NONPRIVATE, "random start")
    return {
        "training_users": population,
        "held_out_identities": int(data.eval_labels.max()) + 1,
        "held_out_images": len(data.eval_labels),
        "users_per_step": n,
        "steps": steps,
        "trained_parameters": parameters,
        "logit_dp_sensitivity_C": sensitivity,
        "naive_dp_sensitivity": naive_sensitivity,
        "noise": noise,
        "runs": runs,
        "recall": table,
        "paired_differences": paired,
    }


# ---------------------------------------------------------------------------------------
# Part B: Logit-DP pretraining -> DP-FedEmb at equal composed ε, through run_train_job.


def _geometric_search(epsilon_at: Callable[[float], float], target: float) -> float:
    """Smallest z (to 0.1%) with epsilon_at(z) <= target; epsilon_at non-increasing."""
    low, high = 0.1, 1.0
    while epsilon_at(high) > target:
        low, high = high, 2 * high
        if high > accounting_spec.MAX_NOISE_MULTIPLIER:
            raise calibration.TargetOutOfReach(f"composed epsilon {target:g} out of reach")
    while high > low * 1.001:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if epsilon_at(middle) > target else (low, middle)
    return high


def part_b(work: str, sizes: Mapping, resamples: int) -> dict:
    p = sizes["pipeline"]
    total = p["epsilon"]
    data, public_dir, public = bench_training.prepare(work, p)
    del public_dir
    num_users = len(partition.PartitionReader(data[0]).user_ids())
    base = dataclasses.replace(bench_training.base_config(p), delta=DELTA)
    logit_config = dataclasses.replace(
        base,
        algorithm=job_config.LOGIT_DP,
        rounds=p["logit_steps"],
        users_per_virtual_client=1,
        virtual_clients_per_round=p["n"],
        clip_norm=CLIP,
        settings={"scale": SCALE},
        server_learning_rate=LR,
        server_momentum=MOMENTUM,
        trainable_layers=model_config.ALL_LAYERS,
        over_selection=0.0,
    )

    def spec(config: job_config.TrainJobConfig, z: float) -> accounting_spec.AccountingSpec:
        return job_plan.accounting_spec_for(
            dataclasses.replace(config, noise_multiplier=z), num_users
        )

    sigma = calibration.calibrate_noise_multiplier(spec(logit_config, 1.0), total * LOGIT_SHARE)
    logit_config = dataclasses.replace(logit_config, noise_multiplier=sigma)
    logit_spec = spec(logit_config, sigma)
    z_after = _geometric_search(
        lambda z: budget.composed_epsilon([logit_spec, spec(base, z)], DELTA), total
    )
    z_alone = calibration.calibrate_noise_multiplier(spec(base, 1.0), total)
    scratch = dataclasses.replace(base, trainable_layers=model_config.ALL_LAYERS)
    z_scratch = calibration.calibrate_noise_multiplier(spec(scratch, 1.0), total)
    results = {"public-pretrained start": public}
    with runtime.session(handle_signals=False):
        results[f"{LOGIT} alone"] = train_job.run_train_job(
            logit_config, *data, os.path.join(work, "logit_dp")
        )
        results[f"{LOGIT} -> dp-fedemb"] = train_job.run_train_job(
            dataclasses.replace(base, noise_multiplier=z_after),
            *data,
            os.path.join(work, "fedemb_after_logit"),
            results[f"{LOGIT} alone"].saved_model_dir,
        )
        results["public -> dp-fedemb"] = train_job.run_train_job(
            dataclasses.replace(base, noise_multiplier=z_alone),
            *data,
            os.path.join(work, "fedemb_public"),
            public.saved_model_dir,
        )
        results["scratch -> dp-fedemb"] = train_job.run_train_job(
            dataclasses.replace(scratch, noise_multiplier=z_scratch),
            *data,
            os.path.join(work, "fedemb_scratch"),
        )
    embeddings, labels = {}, None
    for name, result in results.items():
        labels, embeddings[name] = evaluation.embed_saved_model(result.saved_model_dir, data[1])
        print(f"bench_contrastive: pipeline {name}: {result.recall_at_far}", flush=True)
    table, samples = _recall_table(embeddings, labels, resamples)
    composed = budget.composed_epsilon([logit_spec, spec(base, z_after)], DELTA)
    epsilons = {
        "public-pretrained start": 0.0,
        f"{LOGIT} alone": results[f"{LOGIT} alone"].metrics["epsilon"],
        f"{LOGIT} -> dp-fedemb": composed,
        "public -> dp-fedemb": results["public -> dp-fedemb"].metrics["epsilon"],
        "scratch -> dp-fedemb": results["scratch -> dp-fedemb"].metrics["epsilon"],
    }
    return {
        "total_epsilon": total,
        "logit_share": LOGIT_SHARE,
        "training_users": num_users,
        "logit_dp": {"sigma": sigma, "steps": p["logit_steps"], "users_per_step": p["n"]},
        "dp_fedemb": {
            "z_after_logit_dp": z_after,
            "z_public_start": z_alone,
            "z_scratch": z_scratch,
            "rounds": base.rounds,
            "virtual_clients_per_round": base.virtual_clients_per_round,
            "users_per_virtual_client": base.users_per_virtual_client,
        },
        "epsilon": epsilons,
        "dp_fedemb_alone_epsilon_after_logit": results[f"{LOGIT} -> dp-fedemb"].metrics["epsilon"],
        "recall": table,
        "paired_differences": {
            f"{LOGIT} -> dp-fedemb - public -> dp-fedemb": _paired(
                samples, f"{LOGIT} -> dp-fedemb", "public -> dp-fedemb"
            ),
            f"{LOGIT} -> dp-fedemb - scratch -> dp-fedemb": _paired(
                samples, f"{LOGIT} -> dp-fedemb", "scratch -> dp-fedemb"
            ),
            f"{LOGIT} -> dp-fedemb - {LOGIT} alone": _paired(
                samples, f"{LOGIT} -> dp-fedemb", f"{LOGIT} alone"
            ),
        },
    }


# ---------------------------------------------------------------------------------------
# Plots.


def _axes_grid(columns: int):
    # The object-oriented API with the Agg canvas leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5 * columns, 4), dpi=100)
    FigureCanvasAgg(figure)
    return figure, figure.subplots(1, columns, squeeze=False)[0]


def write_recall_plot(parts: Mapping[str, dict], path: str) -> None:
    """recall@FAR 0.01 against ε with 95% intervals, one panel per data set."""
    figure, axes = _axes_grid(len(parts))
    for ax, (name, part) in zip(axes, parts.items(), strict=True):
        for method, marker in ((LOGIT, "o"), (NAIVE, "s")):
            cells = [part["recall"][f"{method}@eps={e:g}"]["0.01"] for e in EPSILONS]
            values = np.array([c["recall"] for c in cells])
            low = values - np.array([c["interval95"][0] for c in cells])
            high = np.array([c["interval95"][1] for c in cells]) - values
            ax.errorbar(EPSILONS, values, yerr=[low, high], marker=marker, capsize=3, label=method)
        for reference, style in ((NONPRIVATE, "-"), ("random start", ":")):
            cell = part["recall"][reference]["0.01"]
            ax.axhline(cell["recall"], color="grey", linestyle=style, label=f"{reference}")
            ax.axhspan(*cell["interval95"], color="grey", alpha=0.1)
        ax.set_xlabel("user-level ε (strict, δ = 1e-5)")
        ax.set_ylabel("recall@FAR 0.01 (held-out identities)")
        ax.set_title(f"{name}: n = {part['users_per_step']}, {part['steps']} steps")
        ax.set_xticks(EPSILONS)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, format="png")


def write_loss_plot(parts: Mapping[str, dict], path: str) -> None:
    """Held-out contrastive loss / its start value against steps (the paper's Figure 1)."""
    figure, axes = _axes_grid(len(parts))
    styles = dict(zip(EPSILONS, (":", "--", "-"), strict=True))
    for ax, (name, part) in zip(axes, parts.items(), strict=True):
        for method, color in ((LOGIT, "tab:blue"), (NAIVE, "tab:orange")):
            for epsilon in EPSILONS:
                curve = np.array(part["runs"][f"{method}@eps={epsilon:g}"]["relative_loss"])
                ax.plot(
                    *curve.T,
                    color=color,
                    linestyle=styles[epsilon],
                    label=f"{method} ε={epsilon:g}",
                )
        curve = np.array(part["runs"][NONPRIVATE]["relative_loss"])
        ax.plot(*curve.T, color="grey", label=NONPRIVATE)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss / loss at step 0")
        ax.set_title(f"{name}: n = {part['users_per_step']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, format="png")


# ---------------------------------------------------------------------------------------


def run(out_dir: str, quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    work = os.path.join(out_dir, "bench_contrastive_work")
    shutil.rmtree(work, ignore_errors=True)
    began = time.perf_counter()
    trainers = {method: Trainer(method, sizes["n"]) for method in (LOGIT, NAIVE, NONPRIVATE)}
    parts = {}
    for load in (synthetic_data, real_data):
        data = load(sizes)
        parts[data.name] = part_a(data, sizes, trainers)
    part_a_seconds = time.perf_counter() - began
    os.makedirs(out_dir, exist_ok=True)
    recall_plot = os.path.join(out_dir, "bench_contrastive_recall.png")
    loss_plot = os.path.join(out_dir, "bench_contrastive_loss.png")
    write_recall_plot(parts, recall_plot)
    write_loss_plot(parts, loss_plot)
    began = time.perf_counter()
    pipeline = part_b(work, sizes, sizes["bootstrap"])
    return {
        "quick": quick,
        "delta": DELTA,
        "logit_scale": SCALE,
        "clip_norm": CLIP,
        "learning_rate": LR,
        "momentum": MOMENTUM,
        "contrastive": parts,
        "contrastive_seconds": part_a_seconds,
        "pipeline": pipeline,
        "pipeline_seconds": time.perf_counter() - began,
        "plots": [os.path.basename(recall_plot), os.path.basename(loss_plot)],
    }


def main(argv: list[str] | None = None) -> int:
    """This bench alone, its JSON written as run_all writes it (summary.json left alone)."""
    from bench import run_all

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--results-dir", default=run_all.RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = run(args.results_dir, args.quick)
    result = {
        "machine": run_all.machine(),
        "wall_seconds": time.perf_counter() - started,
        "load_average_end_1_5_15": [round(x, 2) for x in os.getloadavg()],
        **result,
    }
    path = os.path.join(args.results_dir, "bench_contrastive.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"bench_contrastive: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
