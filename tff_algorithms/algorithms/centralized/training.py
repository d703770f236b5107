"""The centralized oracle's trainer: non-private SGD with momentum over every training
example (`CentralizedTrainer`), one step of the training loop per epoch
(`jobs/loop.py`, which checkpoints the model, the Keras optimizer, the
epoch, the ledger, epsilon infinite from the first epoch, and the history). The
learning rate and momentum are `server_learning_rate` / `server_momentum` (the paper
lists the centralized learning rate in its server column); the DP fields are ignored.
Also the pipeline's non-private pretraining on public data.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import partition
from tff_algorithms.config import model_config
from tff_algorithms.config.client_config import HeadLossConfig
from tff_algorithms.federated import client_data
from tff_algorithms.jobs import loop
from tff_algorithms.jobs.job_inputs import JobInputs
from tff_algorithms.jobs.job_outputs import JobOutcome
from tff_algorithms.modeling import export, identity_heads, models

_SOFTMAX_LOSS = HeadLossConfig()


class CentralizedTrainer:
    """Non-private oracle: the backbone and a global head, plain SGD with momentum.

    Not a TFF process: one Keras model and optimizer, trained by `train_job`'s own epoch
    loop. One `train_epoch` call is one pass over all training examples, shuffled with a seed
    that depends only on (seed, epoch), so a run restored from a checkpoint of
    `checkpoint_objects()` after epoch e continues exactly as an uninterrupted run.

    Args:
      identity_vocabulary: `identity_heads.identity_keys_vocabulary` of the training identities.
      initial_backbone: start from these backbone weights (e.g. pretrained) instead of
        the seeded initialisation.
      gradient_clip_norm: clip each step's gradient (backbone and head together) to this
        global L2 norm; None: no clip.
    """

    def __init__(
        self,
        backbone_config: model_config.BackboneConfig,
        identity_vocabulary: np.ndarray,
        *,
        learning_rate: float,
        batch_size: int = 32,
        momentum: float = 0.9,
        shuffle_buffer: int = 10_000,
        head_loss: HeadLossConfig = _SOFTMAX_LOSS,
        seed: int = 0,
        initial_backbone: tff.learning.models.ModelWeights | None = None,
        gradient_clip_norm: float | None = None,
    ) -> None:
        self.backbone = models.build_backbone(backbone_config, seed)
        if initial_backbone is not None:
            models.assign_backbone_weights(self.backbone, initial_backbone)
        self._vocabulary = tf.constant(identity_vocabulary, tf.int64)
        self._num_rows = len(identity_vocabulary)
        self.head = tf.Variable(
            models.initial_head_kernel(
                tf.constant([seed, -1], tf.int64), backbone_config.embedding_size, self._num_rows
            )
        )
        self.optimizer = tf.keras.optimizers.SGD(
            learning_rate=learning_rate, momentum=momentum, global_clipnorm=gradient_clip_norm
        )
        self._batch_size = batch_size
        self._shuffle_buffer = shuffle_buffer
        self._head_loss = head_loss
        self._seed = seed
        self._variables = list(self.backbone.trainable_weights) + [self.head]
        # Graph-first like `LocalTrainer.train`: AutoGraph would only rewrite it.
        self._train_step = tf.function(self._step, autograph=False)

    def checkpoint_objects(self) -> dict[str, object]:
        """What a `tf.train.Checkpoint` must hold to resume: weights and optimizer state."""
        return {"backbone": self.backbone, "head": self.head, "optimizer": self.optimizer}

    def _step(self, batch: dict[str, tf.Tensor]) -> tf.Tensor:
        keys = identity_heads.identity_keys(batch["identity"])
        labels, usable = identity_heads.labels_in_vocabulary(keys, self._vocabulary, self._num_rows)
        with tf.GradientTape() as tape:
            embeddings = self.backbone(batch["image"], training=True)
            loss = identity_heads.head_loss(
                identity_heads.head_logits(embeddings, self.head, labels, self._head_loss),
                labels,
                usable,
            )
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self._variables), self._variables))
        return loss

    def train_epoch(self, examples: tf.data.Dataset, epoch: int) -> float:
        """One pass over per-example `{"image", "identity"}`; returns the mean batch loss."""
        batches = examples.shuffle(self._shuffle_buffer, seed=self._seed * 1_000_003 + epoch).batch(
            self._batch_size
        )
        losses = [float(self._train_step(batch)) for batch in batches]
        return float(np.mean(losses)) if losses else float("nan")


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
    trainer = CentralizedTrainer(
        config.backbone_config,
        identity_heads.training_identity_vocabulary(inputs.reader, inputs.user_ids),
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
