"""The centralized oracle's trainer: non-private SGD with momentum over every training
example (`processes.CentralizedTrainer`), one step of the training loop per epoch
(`jobs/loop.py`, which checkpoints the model, the Keras optimizer, the
epoch, the ledger, epsilon infinite from the first epoch, and the history). The
learning rate and momentum are `server_learning_rate` / `server_momentum` (the paper
lists the centralized learning rate in its server column); the DP fields are ignored.
Also the pipeline's non-private pretraining on public data.
"""

from __future__ import annotations

import os

import tensorflow as tf

from beam_jobs import partition
from tff_algorithms.federated import (
    client_data,
    local_training,
    processes,
)
from tff_algorithms.jobs import loop
from tff_algorithms.jobs.job_inputs import JobInputs
from tff_algorithms.jobs.job_outputs import JobOutcome
from tff_algorithms.modeling import export, models


def _all_training_examples(
    reader: partition.PartitionReader, partition_dir: str, image_shape: tuple[int, int, int]
) -> tf.data.Dataset:
    """Every training example, decoded; cached in memory after the first epoch when the
    decoded images fit in `export.DECODED_IN_MEMORY_BYTES` (each epoch decoded them
    again: 0.3-0.4 s of a 2 s epoch in the pipeline's pretraining). A shuffle's order
    depends on its seed and the dataset's length only, so the epochs are the same."""
    parts = sorted({reader.location(u).part_file for u in reader.user_ids()})
    files = [os.path.join(partition_dir, p) for p in parts]
    examples = tf.data.TFRecordDataset(files).map(
        lambda s: client_data.parse_example(s, image_shape)
    )
    fits = export.decoded_fit_in_memory(reader.manifest["records"], image_shape)
    return examples.cache() if fits else examples


def train_centralized(inputs: JobInputs, schedule_seed: int) -> JobOutcome:
    """The centralized oracle's trainer (module docstring). `schedule_seed` is not used:
    the oracle samples no users, and `config.seed` seeds its shuffling."""
    del schedule_seed
    config = inputs.config
    trainer = processes.CentralizedTrainer(
        config.backbone_config,
        local_training.training_identity_vocabulary(inputs.reader, inputs.user_ids),
        learning_rate=config.server_learning_rate,
        batch_size=config.batch_size,
        momentum=config.server_momentum,
        head_loss=config.head_loss_config,
        seed=config.seed,
        initial_backbone=inputs.pretrained,
        gradient_clip_norm=config.gradient_clip_norm,
    )
    examples = _all_training_examples(inputs.reader, inputs.partition_dir, config.image_shape)

    def epoch(e: int, _: tf.Tensor | None) -> None:
        trainer.train_epoch(examples, e)  # its loss is not recorded, as before

    # One step is one epoch; each is checkpointed (an epoch is the oracle's long unit).
    return loop.run(
        inputs,
        loop.Round(
            epoch,
            trainer.checkpoint_objects(),
            lambda: models.backbone_weights(trainer.backbone),
            noisy=False,
            checkpoint_every=1,
        ),
    )
