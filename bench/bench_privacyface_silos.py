"""PrivacyFace's own cross-silo setting (issue 22, item 3, first half): FedAvg against
FedAvg + DPLC-released cluster centers as fixed negatives, a few silos of many identities.

The seed paper (privacyface-dp-local-clusters, Sec. 4) trains 4 clients (silos) of 7K
identities each for M = 10 rounds of FedAvg from a pretrained backbone; every round each
silo runs DPLC on its class centers (T = 512, Q = 1, ρ = 1.3, ε = 1 per release) and the
others add the released centers as negatives to their margin loss. Only the releases are
private; the backbone updates are averaged in the clear. Laptop size here: the synthetic
default (`bench_training`'s data and public sketch pretraining, its held-out identities
for recall@FAR), its training identities regrouped into `silos` silos of consecutive
users (each user one identity), M = 10 and Q = 1 as the paper. ρ and T are scaled by
what they cover, not copied: the paper's first cluster at ρ = 1.3 held 1773 of a
client's 7K centers (25%, its Fig. 4c) in 512-d face embeddings, nearly orthogonal; the
small CNN's 128-d class centers are far more concentrated (mean pairwise cosine about
0.5 at the start), and ρ = 1.3 covers every center of a silo (`margin_coverage_at_start`
records it), so a released center would be the population's mean direction. ρ = 0.7
covers about a quarter (the densest cap at the start), and T = 128 of 400 is that
cap's size, as the paper's T = 512 is below its cluster's; the released center's noise
norm σ·Δ·√d is then close to the paper's. One more arm keeps the paper's ρ = 1.3 as it
is (same T and σ, so the same ε), and one more scores the released centers as plain head
rows, s·cos θ (`shared_negatives.logit: row`, the product's scoring before issue 42),
for comparison with the cap margin. Two more arms train with the paper's own loss,
ArcFace (s·cos(θ_y + m), m = 0.5 as ArcFace publishes, at the CosFace arms' scale s):
FedAvg, and PrivacyFace with the cap margin. `margin_coverage_at_end` records the same
reach under each arm's trained backbone.

Each round, for every silo, from the same global backbone:

- the product's client work, run outside TFF (`local_training.LocalTrainer`, the loop of
  every DP-FedEmb virtual client, on `client_work.make_client_dataset` batches): a fresh
  local head of the silo's identities at their class means, CosFace, the default recipe's
  learning rates and trained layers; the backbone update comes back, the head stays;
- PrivacyFace only: before the round each silo releases `dplc.dplc_release` of its class
  centers (mean unit embedding of each identity under the current backbone), with the
  product's public queries (`shared_negatives`: directions from a public seed at the
  first release, the silo's previous release after it) and exactly T members clipped onto
  the cap; the noisy centers are normalised and every OTHER silo passes them to its local
  training as the fixed negative rows (`ClientConfig.shared_negative_rows`), scored with
  the paper's cap margin μ = s·cos(max(θ − ρ, 0)) at the release's ρ
  (`ClientConfig.shared_negative_cap`). FedAvg runs the same trainer with those rows all
  zero, which the loss masks out exactly.

The server averages the silos' backbone updates (FedAvg, server learning rate 1, as the
paper). Differences from the paper, kept because they are the product's: the queries are
public (Alg. 1's selected query has sensitivity 2, `dplc.py`); heads restart at class
means every round.

Privacy unit: ONE IDENTITY (one class center, one row of a silo's W), as in the paper's
cross-silo setting. Neighbouring silo data sets differ in one identity's center
(substitute-one, m = 1), Δ = 2·sin(min(ρ, π/2))/T (`dplc.dplc_sensitivity`), noise
multiplier σ chosen as the paper's ε = 1 per release at δ = 1e-5 by the classic Gaussian
formula, σ = √(2 ln(1.25/δ)). An identity's center enters its own silo's releases only
(parallel composition across silos), so its cost is M·Q Gaussian releases, composed by
`dplc_releases.releases_epsilon` (RDP, no amplification). It is NOT the product's
user-level guarantee (docs/design.md section 5): the backbone updates here are not private at all.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import shutil
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import partition
from bench import bench_training
from tff_algorithms.algorithms.dp_fedemb import client_work, local_training
from tff_algorithms.config import client_config, job_config
from tff_algorithms.evaluation import scoring as evaluation
from tff_algorithms.modeling import export, models
from tff_algorithms.privacy import dplc, dplc_releases

FULL = {
    **bench_training.FULL,
    "identities": 2000,  # 1600 training identities: 4 silos of 400
    "images": 4,
    "silos": 4,
    "silo_rounds": 10,
    "silo_local_epochs": 1,
    "silo_batch_size": 32,
    "cluster_size": 128,
    "num_clusters": 1,
    "margin": 0.7,
    "bootstrap": 500,
}
QUICK = {
    **bench_training.QUICK,
    "identities": 40,
    "images": 4,
    "silos": 2,
    "silo_rounds": 2,
    "silo_local_epochs": 1,
    "silo_batch_size": 16,
    "cluster_size": 8,
    "num_clusters": 1,
    "margin": 0.7,
    "bootstrap": 20,
}
DELTA = 1e-5
# The paper's per-release epsilon; sigma from the classic Gaussian mechanism's formula.
PAPER_EPSILON_PER_RELEASE = 1.0
FEDAVG = "fedavg"
PRIVACYFACE = "privacyface"
NOISELESS = "privacyface, no noise"
PAPER_MARGIN = "privacyface, paper's margin 1.3"
PLAIN_ROW = "privacyface, plain-row logit"
FEDAVG_ARCFACE = "fedavg, arcface"
PRIVACYFACE_ARCFACE = "privacyface, arcface"
# ArcFace's published additive angular margin (the paper's other loss).
ARCFACE_MARGIN = 0.5
_QUERY_SEED, _NOISE_SEED = 11, 12
_MARGINS = (0.5, 0.7, 1.0, 1.3)


def noise_multiplier_for(epsilon: float, delta: float) -> float:
    """σ (relative to Δ) of the classic Gaussian mechanism at (ε, δ): √(2 ln(1.25/δ))/ε."""
    return math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def _silo_examples(partition_dir: str, silos: int, image_shape: Sequence[int]) -> list[dict]:
    """The training users (one identity each) regrouped into `silos` consecutive blocks:
    per silo its decoded images [N, H, W, C] and identity names [N]."""
    reader = partition.PartitionReader(partition_dir)
    out = []
    for block in np.array_split(np.asarray(reader.user_ids()), silos):
        records = [r for user in block for r in reader.user_records(str(user))]
        images = (
            tf.data.Dataset.from_tensor_slices(tf.constant([r.image for r in records]))
            .map(lambda encoded: export.decode_image(encoded, tuple(image_shape)))
            .batch(512)
        )
        out.append(
            {
                "images": np.concatenate([b.numpy() for b in images]),
                "identities": np.asarray([r.identity for r in records]),
            }
        )
    return out


class _Silos:
    """The silos' data and one traced product client trainer shared by every silo."""

    def __init__(
        self, silo_data: list[dict], config: job_config.TrainJobConfig, negative_rows: int
    ) -> None:
        self.data = silo_data
        self.backbone_config = config.backbone_config
        largest = max(len(s["images"]) for s in silo_data)
        self.client_config = dataclasses.replace(
            config.client_config(),
            head_capacity=max(len(np.unique(s["identities"])) for s in silo_data),
            max_examples=largest,
            shuffle_buffer=largest,
            shared_negative_rows=negative_rows,
        )
        # One traced trainer per head loss and cap angle ρ of the negatives' logits
        # (0: plain rows).
        self._trains: dict[tuple[client_config.HeadLossConfig, float], object] = {}
        self._backbone = models.build_backbone(self.backbone_config)

    def _train(self, head_loss: client_config.HeadLossConfig, negative_cap: float):  # noqa: ANN202 - a tf.function
        key = (head_loss, negative_cap)
        if key not in self._trains:
            config = dataclasses.replace(
                self.client_config, head_loss=head_loss, shared_negative_cap=negative_cap
            )
            trainer = local_training.LocalTrainer(
                lambda: models.build_backbone(self.backbone_config), config, None
            )
            self._trains[key] = tf.function(trainer.train)
        return self._trains[key]

    def class_centers(self, weights: tff.learning.models.ModelWeights, silo: int) -> np.ndarray:
        """[identities, d]: each identity's mean unit embedding, normalised (sorted names)."""
        models.assign_backbone_weights(self._backbone, weights)
        data = self.data[silo]
        embeddings = np.concatenate(
            [
                models.embed(self._backbone, data["images"][i : i + 512]).numpy()
                for i in range(0, len(data["images"]), 512)
            ]
        ).astype(np.float64)
        _, owner = np.unique(data["identities"], return_inverse=True)
        sums = np.zeros((owner.max() + 1, embeddings.shape[1]))
        np.add.at(sums, owner, embeddings)
        return sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)

    def local_update(
        self,
        weights: tff.learning.models.ModelWeights,
        silo: int,
        round_num: int,
        negatives: np.ndarray,
        negative_cap: float,
        head_loss: client_config.HeadLossConfig,
    ) -> tuple[list[np.ndarray], float]:
        """The silo's backbone update (initial − final) from the product's client loop
        under `head_loss`, the negatives' logits capped at angle `negative_cap`, and its
        mean local loss."""
        data = self.data[silo]
        examples = tf.data.Dataset.from_tensor_slices(
            {"image": data["images"], "identity": data["identities"]}
        )
        dataset = client_work.make_client_dataset(
            examples, f"silo{silo}/round{round_num}", self.client_config, len(data["images"])
        )
        state = collections.OrderedDict(
            round_num=tf.constant(round_num, tf.int64),
            head_seed=tf.constant(self.client_config.head_seed, tf.int64),
            shared_negatives=tf.constant(negatives, tf.float32),
        )
        initial = type(weights)(
            trainable=[tf.constant(w) for w in weights.trainable],
            non_trainable=[tf.constant(w) for w in weights.non_trainable],
        )
        result, measurements = self._train(head_loss, negative_cap)(initial, dataset, state)
        if int(measurements["reported"]) != 1:
            raise RuntimeError(f"silo {silo} dropped in round {round_num}: {measurements}")
        return [t.numpy() for t in result.update], float(measurements["loss"])


def _release_diagnostics(
    centers: np.ndarray,
    query: np.ndarray,
    released: np.ndarray,
    others: np.ndarray,
    rho: float,
    t: int,
) -> dict:
    """What a release carried (bench diagnostics on private data, never released)."""
    mean = dplc.cluster_means(centers, rho=rho, cluster_size=t, queries=query[None])[0]
    q = query / np.linalg.norm(query)
    top = np.sort(centers @ q)[::-1][:t]
    cos_rho = math.cos(rho)
    return {
        "signal_norm": float(np.linalg.norm(mean)),
        "cos_released_to_mean": float(released @ mean / np.linalg.norm(mean)),
        "members_inside_cap": float(np.mean(top >= cos_rho)),
        "own_centers_within_rho_of_release": float(np.mean(centers @ released >= cos_rho)),
        "other_silos_centers_within_rho_of_release": float(np.mean(others @ released >= cos_rho)),
        "own_centers_cos_to_release_mean": float(np.mean(centers @ released)),
    }


def margin_coverage(centers: np.ndarray, margins: Sequence[float]) -> dict[str, float]:
    """Per margin ρ: the fraction of the centers in the densest cap of angle ρ around one
    of them (Alg. 1's selected query), the paper's measure of a cluster's reach."""
    similarity = centers @ centers.T
    return {
        format(rho, "g"): float(np.max(np.sum(similarity >= math.cos(rho), axis=1))) / len(centers)
        for rho in margins
    }


def _mean_coverage(silos: _Silos, weights: tff.learning.models.ModelWeights) -> dict:
    """`margin_coverage` of each silo's class centers under `weights`, averaged."""
    each = [
        margin_coverage(silos.class_centers(weights, s), _MARGINS) for s in range(len(silos.data))
    ]
    return {rho: float(np.mean([c[rho] for c in each])) for rho in each[0]}


def train(
    silos: _Silos,
    initial: tff.learning.models.ModelWeights,
    sizes: Mapping,
    noise_multiplier: float | None,
    margin: float,
    cap_margin: bool = True,
    head_loss: client_config.HeadLossConfig | None = None,
) -> tuple[tff.learning.models.ModelWeights, list[dict], list[float]]:
    """M rounds of FedAvg over all silos under `head_loss` (None: the config's); with
    `noise_multiplier` (None: FedAvg alone) each silo releases DPLC centers of margin
    `margin` before every round, which the other silos score with the cap margin at
    that ρ (`cap_margin`; else as plain head rows). Returns (weights, diagnostics, the
    silos' mean local loss by round)."""
    head_loss = head_loss or silos.client_config.head_loss
    c, q, d = len(silos.data), sizes["num_clusters"], silos.backbone_config.embedding_size
    weights = initial
    previous: list[np.ndarray | None] = [None] * c
    diagnostics, losses = [], []
    for round_num in range(sizes["silo_rounds"]):
        released = np.zeros((c, q, d))
        if noise_multiplier is not None:
            centers = [silos.class_centers(weights, s) for s in range(c)]
            round_diag = []
            for s in range(c):
                if previous[s] is None:
                    queries = np.random.default_rng([_QUERY_SEED, s]).standard_normal((q, d))
                else:
                    queries = previous[s]
                noisy = dplc.dplc_release(
                    centers[s],
                    rho=margin,
                    cluster_size=sizes["cluster_size"],
                    noise_multiplier=noise_multiplier,
                    seed=[_NOISE_SEED, s, round_num],
                    queries=queries,
                )
                released[s] = noisy / np.linalg.norm(noisy, axis=1, keepdims=True)
                others = np.concatenate([centers[k] for k in range(c) if k != s])
                round_diag.append(
                    _release_diagnostics(
                        centers[s],
                        queries[0],
                        released[s][0],
                        others,
                        margin,
                        sizes["cluster_size"],
                    )
                )
                previous[s] = released[s]
            diagnostics.append(
                {k: float(np.mean([r[k] for r in round_diag])) for k in round_diag[0]}
            )
        updates, round_losses = [], []
        for s in range(c):
            negatives = np.concatenate([released[k] for k in range(c) if k != s])
            cap = margin if cap_margin and noise_multiplier is not None else 0.0
            update, loss = silos.local_update(weights, s, round_num, negatives, cap, head_loss)
            updates.append(update)
            round_losses.append(loss)
        losses.append(float(np.mean(round_losses)))
        mean_update = [np.mean(parts, axis=0) for parts in zip(*updates)]
        weights = type(weights)(
            trainable=[w - u for w, u in zip(weights.trainable, mean_update, strict=True)],
            non_trainable=list(weights.non_trainable),
        )
    return weights, diagnostics, losses


def run(out_dir: str, quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    work = os.path.join(out_dir, "bench_privacyface_silos_work")
    shutil.rmtree(work, ignore_errors=True)
    data, _, pretrained = bench_training.prepare(work, sizes)
    config = bench_training.base_config(sizes)
    config = dataclasses.replace(
        config, local_epochs=sizes["silo_local_epochs"], batch_size=sizes["silo_batch_size"]
    )
    silo_data = _silo_examples(data[0], sizes["silos"], config.backbone_config.image_shape)
    q = sizes["num_clusters"]
    silos = _Silos(silo_data, config, (sizes["silos"] - 1) * q)
    start = models.backbone_weights(
        models.load_pretrained_backbone(config.backbone_config, pretrained.saved_model_dir)
    )
    coverage = _mean_coverage(silos, start)
    z = noise_multiplier_for(PAPER_EPSILON_PER_RELEASE, DELTA)
    cosface = silos.client_config.head_loss
    arcface = dataclasses.replace(cosface, loss=client_config.ARCFACE, margin=ARCFACE_MARGIN)
    arms = {
        FEDAVG: (None, sizes["margin"], True, cosface),
        PRIVACYFACE: (z, sizes["margin"], True, cosface),
        NOISELESS: (0.0, sizes["margin"], True, cosface),
        PAPER_MARGIN: (z, 1.3, True, cosface),
        PLAIN_ROW: (z, sizes["margin"], False, cosface),
        FEDAVG_ARCFACE: (None, sizes["margin"], True, arcface),
        PRIVACYFACE_ARCFACE: (z, sizes["margin"], True, arcface),
    }
    models_dirs, diagnostics, coverage_at_end, losses = {}, {}, {}, {}
    for name, (noise, margin, cap_margin, head_loss) in arms.items():
        weights, diagnostics[name], losses[name] = train(
            silos, start, sizes, noise, margin, cap_margin, head_loss
        )
        coverage_at_end[name] = _mean_coverage(silos, weights)
        models_dirs[name] = export.export_serving_model(
            config.backbone_config, weights, os.path.join(work, name.replace(" ", "_"))
        )
        print(f"bench_privacyface_silos: trained {name}", flush=True)
    models_dirs["public-pretrained start"] = pretrained.saved_model_dir
    compared = evaluation.compare_saved_models(models_dirs, data[1], sizes["bootstrap"])
    # The ArcFace release arm against ArcFace FedAvg, on the same resamples (same seed).
    arcface_pair = evaluation.compare_saved_models(
        {name: models_dirs[name] for name in (FEDAVG_ARCFACE, PRIVACYFACE_ARCFACE)},
        data[1],
        sizes["bootstrap"],
    )
    identities = min(len(np.unique(s["identities"])) for s in silo_data)
    sensitivity = dplc.dplc_sensitivity(
        rho=sizes["margin"], cluster_size=sizes["cluster_size"], public_queries=True
    )
    plan = dplc_releases.ReleasePlan(
        every_rounds=1,
        num_clusters=q,
        noise_multiplier=z,
        cluster_size=sizes["cluster_size"],
        margin=sizes["margin"],
        pool_users=identities,
        sensitivity=sensitivity,
    )
    d = config.backbone_config.embedding_size
    return {
        "quick": quick,
        "setting": {
            "silos": sizes["silos"],
            "identities_per_silo": [len(np.unique(s["identities"])) for s in silo_data],
            "images_per_silo": [len(s["images"]) for s in silo_data],
            "rounds": sizes["silo_rounds"],
            "local_epochs": sizes["silo_local_epochs"],
            "batch_size": sizes["silo_batch_size"],
            "client_learning_rate": config.client_learning_rate,
            "head_learning_rate_scale": config.resolved_head_lr_scale,
            "trainable_layers": list(config.trainable_layers),
            "head_loss": config.head_loss,
            "head_loss_by_arm": {name: dataclasses.asdict(arm[3]) for name, arm in arms.items()},
            "server": "FedAvg, plain average of the silos' backbone updates",
            "held_out_identities": compared[FEDAVG]["identities"],
        },
        "dplc": {
            "cluster_size": sizes["cluster_size"],
            "num_clusters": q,
            "margin": sizes["margin"],
            "queries": "public: public-seed directions, then the silo's previous release",
            "negative_logit": (
                "s*cos(max(theta - rho, 0)) at the release's rho (PrivacyFace's cap margin); "
                f"{PLAIN_ROW!r}: s*cos(theta)"
            ),
            "sensitivity": sensitivity,
            "noise_multiplier": z,
            "noise_norm": z * sensitivity * math.sqrt(d),
            "paper_margin_arm": {
                "margin": 1.3,
                "sensitivity": dplc.dplc_sensitivity(
                    rho=1.3, cluster_size=sizes["cluster_size"], public_queries=True
                ),
                "noise_norm": z
                * dplc.dplc_sensitivity(
                    rho=1.3, cluster_size=sizes["cluster_size"], public_queries=True
                )
                * math.sqrt(d),
                "epsilon": "the same: σ is relative to Δ, so ε does not depend on ρ",
            },
            "paper_noise_norm": z * dplc.paper_sensitivity(512, 1.3) * math.sqrt(512),
            "privacy_unit": (
                "one identity (one class center of one silo), substitute-one; parallel across "
                "silos; NOT the product's user-level guarantee: backbone updates are not private"
            ),
            "delta": DELTA,
            "epsilon_per_release_classic": PAPER_EPSILON_PER_RELEASE,
            "epsilon_paper_basic_composition": PAPER_EPSILON_PER_RELEASE * q * sizes["silo_rounds"],
            "epsilon_rdp": dplc_releases.releases_epsilon(plan, sizes["silo_rounds"], DELTA),
        },
        "margin_coverage_at_start": coverage,
        "margin_coverage_at_end": coverage_at_end,
        "release_diagnostics_by_round": diagnostics,
        # The local loss includes the negatives' terms: it shows how much they weigh.
        "client_loss_by_round": losses,
        "recall": {
            name: {
                "recall_at_far": r["recall_at_far"],
                "interval95": r["recall_at_far_interval"],
            }
            for name, r in compared.items()
        },
        # Each arm minus FedAvg (CosFace), and the ArcFace release arm minus ArcFace
        # FedAvg, on the same bootstrap resamples.
        "paired_minus_fedavg": _minus_first(compared[FEDAVG]["versus"]),
        "paired_minus_fedavg_arcface": _minus_first(arcface_pair[FEDAVG_ARCFACE]["versus"]),
    }


def _minus_first(versus: Mapping) -> dict:
    """compare_saved_models' "versus" (the first model minus each other one), turned
    into each other model minus the first."""
    return {
        name: {
            far: {
                "difference": 0.0 - gain["difference"],  # 0.0 - x: never -0.0
                "interval": [0.0 - gain["interval"][1], 0.0 - gain["interval"][0]],
            }
            for far, gain in gains.items()
        }
        for name, gains in versus.items()
    }
