"""Training benchmark on the synthetic default with the small CNN (issue 5).

The paper's setting at laptop scale: a backbone pretrained without privacy on public data
of another domain (sketches), then trained on the private users' photos. Utility:
recall@FAR on held-out identities of the public-pretrained start, the centralized oracle
(non-private, every layer, from the same start) and DP-FedEmb, DP-FedAvg and
DP-FTRL-FedEmb at noise multiplier 0 and two positive values, with the same schedule,
rounds and trained layers (the pipeline default's convolutions and GroupNorm layers), and
the epsilon of each. DP-FedEmb and the oracle also with the paper's softmax head loss (the
default is CosFace), DP-FedEmb with the paper's randomly initialised local heads (the
default starts them at class means), and noiseless with every layer trained for longer,
against the oracle with the same loss.

Speed (round time vs a tuned plain TensorFlow loop, workers, scaling, FLOP/s) is
`bench/bench_speed.py`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping

import numpy as np

from beam_jobs import partition_job, synthetic
from tff_algorithms.config import client_config, job_config, model_config, recipes
from tff_algorithms.federated import dropouts, runtime
from tff_algorithms.jobs import job_outputs, train_job

FULL = {
    "identities": 1000,
    "images": 4,
    "public_identities": 300,
    "public_images": 10,
    "pretrain_epochs": 12,
    "rounds": 20,
    "virtual_clients_per_round": 12,
    "epochs": 8,
    "noise": (1.0, 2.0),
    "noiseless_rounds": 60,
}
QUICK = {
    "identities": 80,
    "images": 4,
    "public_identities": 20,
    "public_images": 4,
    "pretrain_epochs": 3,  # after 1 epoch every-layer local training diverges
    "rounds": 3,
    "virtual_clients_per_round": 4,
    "epochs": 1,
    "noise": (1.0, 2.0),
    "noiseless_rounds": 2,
}
HELD_OUT_FRACTION = 0.2
# A larger trunk than the default small CNN, for a benchmark's sizes under "trunk"
# (absent: the small CNN on 28x28 images, every benchmark's default). A Keras
# application needs at least 32x32 images. Its default recipe's layers ("conv*",
# "gn*") name no layer of this trunk, so it names the layers its private training
# updates: the trunk's last convolution and its GroupNorm, and the embedding
# (`bench_transfer_recipes` says why). It pretrains on public photos of other
# identities, not on the sketches: from the sketches its start stays at chance on the
# photos at 32x32 (BENCHMARKS.md, "The same arms on MobileNetV2").
MOBILENET_V2_TRUNK = {
    "architecture": model_config.MOBILENET_V2,
    "image_size": 32,
    "trainable_layers": ("Conv_1", "Conv_1_bn", "embedding"),
    "public_style": synthetic.PHOTO,
}
# The algorithms this benchmark trains at each noise (the others have their own benchmarks).
_FEDERATED = (job_config.DP_FEDEMB, job_config.DP_FEDAVG, job_config.DP_FTRL_FEDEMB)
_RANDOM_HEAD = f"{job_config.DP_FEDEMB} random head"
_SOFTMAX = "softmax loss"
_NOISELESS = f"{job_config.DP_FEDEMB} z=0 every layer"


def image_size(sizes: Mapping) -> int:
    """The side of the square images of `sizes`' trunk."""
    return sizes.get("trunk", {}).get("image_size", synthetic.SyntheticConfig.image_size)


def _trunk_model(sizes: Mapping) -> dict:
    """The recipe keys that choose `sizes`' trunk (none for the small CNN)."""
    trunk = sizes.get("trunk", {})
    return {key: trunk[key] for key in ("architecture", "image_size") if key in trunk}


def _at_bench_size(recipe: Mapping, sizes: Mapping) -> job_config.TrainJobConfig:
    values = recipes.overlay(
        recipe,
        {
            **_trunk_model(sizes),
            "rounds": sizes["rounds"],
            "noise_multiplier": 0.0,
            "virtual_clients_per_round": sizes["virtual_clients_per_round"],
            "evaluate_every": 0,
            "seed": 0,
            # Every algorithm samples the same users in the same rounds, run after run.
            "schedule_seed": 0,
            "testing_fixed_schedule": True,
            "noise_seed": 1,
            "testing_fixed_noise": True,
            "delta": 1e-5,
        },
    )
    return job_config.TrainJobConfig(**recipes.job_fields(values))


def base_config(sizes: Mapping) -> job_config.TrainJobConfig:
    """The default recipe's private training (tff_algorithms/config/recipes.py), at the
    bench's size, training the layers of `sizes`' trunk if it names them."""
    recipe = recipes.DEFAULT
    if "trainable_layers" in sizes.get("trunk", {}):
        recipe = recipes.overlay(recipe, {"trainable_layers": sizes["trunk"]["trainable_layers"]})
    return _at_bench_size(recipe, sizes)


def centralized_config(sizes: Mapping, epochs: int) -> job_config.TrainJobConfig:
    """The default (centralized, every layer) pretraining recipe for `epochs`, for
    `sizes`' trunk (whose pretraining recipe may differ)."""
    recipe = recipes.pretrain_values(recipes.overlay(recipes.DEFAULT, _trunk_model(sizes)), {})
    return dataclasses.replace(_at_bench_size(recipe, sizes), rounds=epochs)


def _write_data(
    root: str,
    identities: int,
    images: int,
    size: int = synthetic.SyntheticConfig.image_size,
) -> tuple[str, str]:
    """Private photo users: (training partition, held-out records) under ROOT, images
    of `size` x `size` pixels."""
    config = synthetic.SyntheticConfig(
        identities=identities, images_per_identity=images, image_size=size, seed=0
    )
    train_identities = int(identities * (1 - HELD_OUT_FRACTION))
    return partition_job.write_training_inputs(
        root,
        synthetic.records_for_identities(config, 0, train_identities),
        synthetic.records_for_identities(config, train_identities, identities),
        num_shards=4,
    )


def prepare(work: str, sizes: Mapping) -> tuple[tuple[str, str], str, job_outputs.TrainJobResult]:
    """Under WORK: private data (training partition, held-out records), public sketches of
    other identities (their partition), and the backbone pretrained on those with the
    pipeline's head loss, evaluated on the private held-out photos."""
    data = _write_data(work, sizes["identities"], sizes["images"], image_size(sizes))
    public_dir, pretrained = public_pretrained(work, sizes, data[1])
    return data, public_dir, pretrained


def public_pretrained(
    work: str, sizes: Mapping, eval_dir: str
) -> tuple[str, job_outputs.TrainJobResult]:
    """Under WORK: the public identities' partition (sketches, unless `sizes`' trunk
    names another style) and the backbone pretrained on them, evaluated on the held-out
    records in `eval_dir`."""
    public = synthetic.SyntheticConfig(
        identities=sizes["public_identities"],
        images_per_identity=sizes["public_images"],
        image_size=image_size(sizes),
        seed=1,
        style=sizes.get("trunk", {}).get("public_style", synthetic.SKETCH),
    )
    public_dir, _ = partition_job.write_training_inputs(
        os.path.join(work, "public"),
        synthetic.records_for_identities(public, 0, public.identities),
        num_shards=4,
    )
    return public_dir, pretrain(work, sizes, public_dir, eval_dir)


def pretrain(
    work: str, sizes: Mapping, public_dir: str, eval_dir: str, head_loss: str | None = None
) -> job_outputs.TrainJobResult:
    """The pipeline's pretraining (centralized, every layer) on the public partition, with
    `head_loss` instead of the pipeline's if given."""
    config = centralized_config(sizes, sizes["pretrain_epochs"])
    if head_loss is not None:
        config = dataclasses.replace(config, head_loss=head_loss)
    output = os.path.join(work, "pretrained" if head_loss is None else f"pretrained_{head_loss}")
    with runtime.session(handle_signals=False):
        return train_job.run_train_job(config, public_dir, eval_dir, output)


def run(out_dir: str, quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    work = os.path.join(out_dir, "bench_training_work")
    shutil.rmtree(work, ignore_errors=True)
    data, public_dir, pretrained = prepare(work, sizes)
    # The paper's loss from a start pretrained with it (the same pretraining, softmax):
    # from the CosFace-pretrained start, softmax local training of every layer diverged.
    pretrained_softmax = pretrain(work, sizes, public_dir, data[1], client_config.SOFTMAX)
    base = base_config(sizes)
    centralized = centralized_config(sizes, sizes["epochs"])
    configs = {"centralized": centralized}
    softmax = {"head_loss": client_config.SOFTMAX}
    softmax_configs = {
        f"centralized {_SOFTMAX}": dataclasses.replace(centralized, **softmax),
    }
    for algorithm in _FEDERATED:
        for noise in (0.0, *sizes["noise"]):
            configs[f"{algorithm}@z={noise:g}"] = dataclasses.replace(
                base, algorithm=algorithm, noise_multiplier=noise
            )
    # The paper's loss (softmax) and local head start (random) against the default's.
    for noise in (0.0, max(sizes["noise"])):
        softmax_configs[f"{job_config.DP_FEDEMB} {_SOFTMAX}@z={noise:g}"] = dataclasses.replace(
            base, noise_multiplier=noise, **softmax
        )
        configs[f"{_RANDOM_HEAD}@z={noise:g}"] = dataclasses.replace(
            base, head_init=client_config.HEAD_INIT_RANDOM, noise_multiplier=noise
        )
    # "Federated without noise close to centralized": every layer, as the oracle trains,
    # server momentum 0.9, and three times the bench's rounds; with either loss.
    noiseless = dataclasses.replace(
        base,
        trainable_layers=model_config.ALL_LAYERS,
        rounds=sizes["noiseless_rounds"],
        server_learning_rate=1.0,
        server_momentum=0.9,
    )
    configs[_NOISELESS] = noiseless
    softmax_configs[f"{_NOISELESS} {_SOFTMAX}"] = dataclasses.replace(noiseless, **softmax)
    utility = {
        **train_each("bench_training", configs, data, work, _utility, pretrained.saved_model_dir),
        **train_each(
            "bench_training",
            softmax_configs,
            data,
            work,
            _utility,
            pretrained_softmax.saved_model_dir,
        ),
    }
    return {
        "quick": quick,
        "data": {
            "identities": sizes["identities"],
            "images_per_identity": sizes["images"],
            "held_out_fraction": HELD_OUT_FRACTION,
            "public": {
                "identities": sizes["public_identities"],
                "images_per_identity": sizes["public_images"],
                "style": synthetic.SKETCH,
                "pretrain_epochs": sizes["pretrain_epochs"],
            },
        },
        "schedule": {
            "users_per_virtual_client": base.users_per_virtual_client,
            "virtual_clients_per_round": base.virtual_clients_per_round,
            "rounds": base.rounds,
            "clip_norm": base.clip_norm,
            "trainable_layers": list(base.trainable_layers),
            "head_init": base.head_init,
            "head_loss": dataclasses.asdict(base.head_loss_config),
            "class_means_norm": base.class_means_norm,
            "noiseless_rounds": sizes["noiseless_rounds"],
        },
        "pretrained": held_out_recall(pretrained),
        f"pretrained {_SOFTMAX}": held_out_recall(pretrained_softmax),
        "utility": utility,
        "recall_ordering_at_max_noise": _ordering(utility, max(sizes["noise"])),
    }


def train_each(
    label: str,
    configs: Mapping[str, job_config.TrainJobConfig],
    data: tuple[str, str],
    work: str,
    describe: Callable[[job_config.TrainJobConfig, job_outputs.TrainJobResult], dict],
    pretrained_backbone: str | None = None,
) -> dict[str, dict]:
    """Trains each named config on `data` (partition_dir, eval_dir) into WORK/<name>,
    from `pretrained_backbone` if given, on one TFF runtime owned for the whole loop.

    Returns name -> describe(config, result), or {"failed": why} for a job stopped by
    rounds without enough reports (diverged local training), and prints each line as its
    job ends, so a long benchmark shows progress under `label`.
    """
    described: dict[str, dict] = {}
    with runtime.session(handle_signals=False):
        for name, config in configs.items():
            try:
                result = train_job.run_train_job(
                    config, *data, os.path.join(work, name), pretrained_backbone
                )
            except dropouts.RoundBelowMinimumReports as error:
                # A recipe that diverges is a result too; the other rows still run.
                described[name] = {"failed": str(error)}
            else:
                described[name] = describe(config, result)
            print(f"{label}: {name}: {described[name]}", flush=True)
    return described


def held_out_recall(result: job_outputs.TrainJobResult) -> dict[str, float]:
    """The job's recall at FAR 1e-3, 1e-2 and 1e-1 on held-out identities."""
    return {
        "recall_at_far_1e-3": result.recall_at_far["0.001"],
        "recall_at_far_1e-2": result.recall_at_far["0.01"],
        "recall_at_far_1e-1": result.recall_at_far["0.1"],
    }


def _utility(config: job_config.TrainJobConfig, result: job_outputs.TrainJobResult) -> dict:
    if config.algorithm == job_config.CENTRALIZED:
        # Not private, so no (epsilon, delta); its rounds are epochs over the training users.
        return {**held_out_recall(result), "epsilon": None, "epochs": config.rounds}
    return {
        **held_out_recall(result),
        "epsilon": result.metrics["epsilon"],
        "delta": result.metrics["delta"],
        "rounds": result.metrics["rounds"],
    }


def _ordering(utility: dict[str, dict], noise: float) -> list[str]:
    names = [f"{a}@z={noise:g}" for a in _FEDERATED]
    return sorted(names, key=lambda n: -np.nan_to_num(utility[n].get("recall_at_far_1e-3", np.nan)))
