"""Shared identities, the paper's EMNIST setting at laptop scale (issue 38, item 6).

Every user holds several identities drawn Zipf-like from one pool, as EMNIST's writers
write the same characters (`beam_jobs.synthetic`, `users_sharing_identities`). The
protocol is split mode `identity` (the paper's EMNIST protocol: held-out characters):
identities are split by the split's hash, each user's records of held-out identities are
evaluated and never trained on, the rest train, so evaluation users are training users.
DP-FedEmb (local heads, class-mean start, one row per identity a virtual client holds)
and DP-FedAvg (a global head over the training identities) train the small two-conv CNN
from a random start (every layer) on the same schedule, each at the same strict target
epsilon (noise calibrated for the training users), and are scored on the held-out
identities' records by exact recall@FAR with 95% bootstrap intervals over identities and
DP-FedEmb's difference from DP-FedAvg with the paired interval
(`evaluation.compare_saved_models`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping

from beam_jobs import partition, partition_job, split_protocols, synthetic
from bench.bench_training import base_config, train_each
from tff_algorithms.config import job_config, model_config
from tff_algorithms.evaluation import scoring as evaluation
from tff_algorithms.jobs import job_outputs

FULL = {
    "identities": 48,
    "users": 240,
    "identities_per_user": 4,
    "images": 3,
    "rounds": 30,
    "users_per_virtual_client": 4,
    "virtual_clients_per_round": 8,
    "target_epsilon": 8.0,
    "resamples": 500,
}
QUICK = {
    "identities": 16,
    "users": 40,
    "identities_per_user": 3,
    "images": 2,
    "rounds": 2,
    "users_per_virtual_client": 2,
    "virtual_clients_per_round": 3,
    "target_epsilon": 8.0,
    "resamples": 50,
}
# The share of identities held out for evaluation (split mode identity's test band).
HELD_OUT_FRACTION = 0.3
_ALGORITHMS = (job_config.DP_FEDEMB, job_config.DP_FEDAVG)


def _write_data(root: str, sizes: Mapping) -> tuple[str, str]:
    """(training partition, held-out records) under ROOT: split mode identity by hand,
    each record to its identity's side."""
    config = synthetic.SyntheticConfig(
        identities=sizes["identities"],
        images_per_identity=sizes["images"],
        identities_per_user=sizes["identities_per_user"],
        users_sharing_identities=sizes["users"],
        seed=0,
    )
    split = split_protocols.SplitConfig(0.0, HELD_OUT_FRACTION, mode=split_protocols.IDENTITY)
    train, held_out = [], []
    for record in synthetic.records_for_units(config, 0, config.units):
        side = (
            held_out
            if split_protocols.identity_split(record.identity, split) == split_protocols.TEST
            else train
        )
        side.append(record)
    return partition_job.write_training_inputs(root, train, held_out, num_shards=4)


def _config(sizes: Mapping, algorithm: str, head_capacity: int) -> job_config.TrainJobConfig:
    schedule = {k: sizes[k] for k in ("rounds", "virtual_clients_per_round")}
    return dataclasses.replace(
        base_config(schedule),
        algorithm=algorithm,
        users_per_virtual_client=sizes["users_per_virtual_client"],
        trainable_layers=model_config.ALL_LAYERS,  # from a random start
        noise_multiplier=None,
        target_epsilon=sizes["target_epsilon"],
        head_capacity=head_capacity if algorithm == job_config.DP_FEDEMB else None,
        head_lr_scale=None,  # each algorithm's default (the paper's)
    )


def _describe(config: job_config.TrainJobConfig, result: job_outputs.TrainJobResult) -> dict:
    return {
        "saved_model": result.saved_model_dir,
        "epsilon": result.metrics["epsilon"],
        "delta": result.metrics["delta"],
        "noise_multiplier": result.metrics["noise_multiplier_source"]["noise_multiplier"],
        "rounds": result.metrics["rounds"],
    }


def run(out_dir: str, quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    work = os.path.join(out_dir, "bench_shared_identities_work")
    shutil.rmtree(work, ignore_errors=True)
    data = _write_data(work, sizes)
    manifest = partition.read_manifest(data[0])
    # A row for every identity the users of a virtual client may hold (train_job refuses less).
    head_capacity = partition.most_identities_of_users(manifest, sizes["users_per_virtual_client"])
    configs = {a: _config(sizes, a, head_capacity) for a in _ALGORITHMS}
    trained = train_each("bench_shared_identities", configs, data, work, _describe)
    models = {name: row["saved_model"] for name, row in trained.items() if "saved_model" in row}
    compared = (
        evaluation.compare_saved_models(
            models, data[1], sizes["resamples"], split_mode=split_protocols.IDENTITY
        )
        if len(models) == len(_ALGORITHMS)
        else {}
    )
    results = {}
    for name, row in trained.items():
        scored = compared.get(name, {})
        results[name] = {
            **{k: v for k, v in row.items() if k != "saved_model"},
            "recall_at_far": scored.get("recall_at_far"),
            "recall_at_far_interval": scored.get("recall_at_far_interval"),
        }
    versus = compared.get(job_config.DP_FEDEMB, {}).get("versus", {}).get(job_config.DP_FEDAVG)
    held_out = compared.get(job_config.DP_FEDEMB, {})
    shutil.rmtree(work, ignore_errors=True)
    return {
        "quick": quick,
        "data": {
            "identities": sizes["identities"],
            "users": sizes["users"],
            "identities_per_user": sizes["identities_per_user"],
            "images_per_holding": sizes["images"],
            "held_out_fraction_of_identities": HELD_OUT_FRACTION,
            "training_users": manifest["users"],
            "identities_per_user_histogram": manifest[partition.IDENTITIES_PER_USER],
            "held_out_images": held_out.get("images"),
            "held_out_identities": held_out.get("identities"),
            "genuine_pairs": held_out.get("genuine_pairs"),
        },
        "protocol": split_protocols.IDENTITY,
        "schedule": {
            "rounds": sizes["rounds"],
            "users_per_virtual_client": sizes["users_per_virtual_client"],
            "virtual_clients_per_round": sizes["virtual_clients_per_round"],
            "target_epsilon": sizes["target_epsilon"],
            "dp_fedemb_head_capacity": head_capacity,
            "trainable_layers": list(model_config.ALL_LAYERS),
            "bootstrap_resamples": sizes["resamples"],
        },
        "results": results,
        "dp_fedemb_minus_dp_fedavg": versus,
    }
