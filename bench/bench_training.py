"""Training benchmark on the synthetic default with the small CNN (issue 5).

Utility: recall@FAR=1e-3 on held-out identities for the centralized oracle and for
DP-FedEmb, DP-FedAvg and DP-FTRL-FedEmb at noise multiplier 0 and two positive values,
same schedule and rounds, with the epsilon of each (tiny populations make these epsilons
large: the point is the utility ordering, as in the paper's Fig. 2a).

Speed: seconds per TFF round (DP-FedEmb, noise 0, rounds after the first, which
compiles), and the same local steps on the same virtual clients in a plain TensorFlow
loop (tf.function per step, eager Python over clients), and their ratio.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time

import apache_beam as beam
import numpy as np
import tensorflow as tf

from beam_jobs import partition, records_io, schema, synthetic
from tff_algorithms import client_data, client_work, models, runtime, train_job

_FULL = {"identities": 300, "images": 10, "rounds": 40, "epochs": 8, "noise": (0.02, 0.1)}
_QUICK = {"identities": 60, "images": 6, "rounds": 4, "epochs": 2, "noise": (0.02, 0.1)}
_HELD_OUT_FRACTION = 0.2


def _base_config(rounds: int) -> train_job.TrainJobConfig:
    return train_job.TrainJobConfig(
        rounds=rounds,
        noise_multiplier=0.0,
        clip_norm=1.0,
        users_per_virtual_client=4,
        virtual_clients_per_round=8,
        client_learning_rate=0.05,
        client_momentum=0.9,
        server_learning_rate=1.0,
        server_momentum=0.0,
        head_lr_scale=10.0,
        batch_size=16,
        embedding_size=32,
        evaluate_every=0,
        seed=0,
        noise_seed=1,
        delta=1e-5,
    )


def _write_data(root: str, identities: int, images: int) -> tuple[str, str]:
    config = synthetic.SyntheticConfig(identities=identities, images_per_identity=images, seed=0)
    train_identities = int(identities * (1 - _HELD_OUT_FRACTION))
    records = [
        schema.serialize(r) for r in synthetic.records_for_identities(config, 0, train_identities)
    ]
    partition_dir, eval_dir = os.path.join(root, "partition"), os.path.join(root, "eval")
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | beam.Create(records) | partition.PartitionByUser(partition_dir, num_shards=4)
    os.makedirs(eval_dir)
    with tf.io.TFRecordWriter(os.path.join(eval_dir, "records-00000-of-00001.tfrecord")) as w:
        for record in synthetic.records_for_identities(config, train_identities, identities):
            w.write(schema.serialize(record))
    return partition_dir, eval_dir


def _plain_round_seconds(
    config: train_job.TrainJobConfig, partition_dir: str, rounds: range
) -> float:
    """Median seconds of the same local steps as a TFF round, in plain TensorFlow."""
    reader = partition.PartitionReader(partition_dir)
    user_ids = reader.user_ids()
    ids = client_data.VirtualClientIds(
        partition_dir, train_job.schedule_for(config, len(user_ids)), user_ids
    )
    client_config = config.client_config()
    backbone = models.build_backbone(config.backbone_config)
    head = tf.Variable(tf.zeros([config.embedding_size, client_config.head_capacity]))
    # One optimizer for backbone and head: the same steps and cost (only speed is measured).
    optimizer = tf.keras.optimizers.SGD(
        client_config.backbone_learning_rate, momentum=client_config.momentum
    )
    variables = list(backbone.trainable_weights) + [head]

    @tf.function
    def step(batch, vocabulary):
        labels, usable = client_work.labels_in_vocabulary(
            client_work.identity_keys(batch["identity"]), vocabulary, client_config.head_capacity
        )
        with tf.GradientTape() as tape:
            logits = client_work.head_logits(
                backbone(batch["image"], training=True),
                head,
                labels,
                client_config.head_loss,
                tf.size(vocabulary),
            )
            loss = client_work.head_loss(logits, labels, usable)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    initial = [v.numpy() for v in variables]
    durations = []
    for round_num in rounds:
        started = time.perf_counter()
        for virtual_client_id in ids.for_round(round_num):
            for variable, value in zip(variables, initial):
                variable.assign(value)
            dataset = client_work.make_client_dataset(
                client_data.load_examples(tf.constant(virtual_client_id), config.image_shape),
                virtual_client_id,
                client_config,
            )
            keys = [client_work.identity_keys(b["identity"]) for b in dataset]
            vocabulary = tf.sort(tf.unique(tf.concat(keys, 0)).y)
            for batch in dataset.repeat(client_config.epochs):
                step(batch, vocabulary)
        durations.append(time.perf_counter() - started)
    return statistics.median(durations)


def run(out_dir: str, quick: bool) -> dict:
    sizes = _QUICK if quick else _FULL
    work = os.path.join(out_dir, "bench_training_work")
    shutil.rmtree(work, ignore_errors=True)
    partition_dir, eval_dir = _write_data(work, sizes["identities"], sizes["images"])
    base = _base_config(sizes["rounds"])
    utility: dict[str, dict] = {}
    runtime.start(handle_signals=False)
    try:
        central = dataclasses.replace(
            base, algorithm=train_job.CENTRALIZED, rounds=sizes["epochs"], server_learning_rate=0.05
        )
        result = train_job.run_train_job(
            central, partition_dir, eval_dir, os.path.join(work, "centralized")
        )
        utility["centralized"] = {
            "recall_at_far_1e-3": result.recall_at_far["0.001"],
            "recall_at_far_1e-2": result.recall_at_far["0.01"],
            "epsilon": None,
            "epochs": sizes["epochs"],
        }
        tff_round_seconds = None
        for algorithm in (train_job.DP_FEDEMB, train_job.DP_FEDAVG, train_job.DP_FTRL_FEDEMB):
            for noise in (0.0, *sizes["noise"]):
                config = dataclasses.replace(base, algorithm=algorithm, noise_multiplier=noise)
                name = f"{algorithm}@z={noise:g}"
                result = train_job.run_train_job(
                    config, partition_dir, eval_dir, os.path.join(work, name)
                )
                utility[name] = {
                    "recall_at_far_1e-3": result.recall_at_far["0.001"],
                    "recall_at_far_1e-2": result.recall_at_far["0.01"],
                    "epsilon": result.metrics["epsilon"],
                    "delta": result.metrics["delta"],
                    "rounds": result.metrics["rounds"],
                }
                print(f"bench_training: {name}: {utility[name]}", flush=True)
                if algorithm == train_job.DP_FEDEMB and noise == 0.0:
                    seconds = [r["round_seconds"] for r in result.metrics["history"][1:]]
                    tff_round_seconds = statistics.median(seconds) if seconds else None
    finally:
        runtime.stop()
    plain = _plain_round_seconds(base, partition_dir, range(1, min(base.rounds, 6)))
    return {
        "quick": quick,
        "data": {
            "identities": sizes["identities"],
            "images_per_identity": sizes["images"],
            "held_out_fraction": _HELD_OUT_FRACTION,
        },
        "schedule": {
            "users_per_virtual_client": base.users_per_virtual_client,
            "virtual_clients_per_round": base.virtual_clients_per_round,
            "rounds": base.rounds,
            "clip_norm": base.clip_norm,
        },
        "utility": utility,
        "speed": {
            "tff_round_seconds": tff_round_seconds,
            "plain_tf_round_seconds": plain,
            "tff_over_plain": (tff_round_seconds / plain) if tff_round_seconds else None,
        },
        "recall_ordering_at_max_noise": _ordering(utility, max(sizes["noise"])),
    }


def _ordering(utility: dict[str, dict], noise: float) -> list[str]:
    names = [f"{a}@z={noise:g}" for a in train_job.ALGORITHMS if a != train_job.CENTRALIZED]
    return sorted(names, key=lambda n: -np.nan_to_num(utility[n]["recall_at_far_1e-3"]))
