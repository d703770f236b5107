"""The training population of a one-run privacy audit (`tff_algorithms.jobs.audit`).

The population has `canaries` slots. Slot i holds canary user i with probability 1/2
(an independent, seeded draw) and otherwise filler user i: both are ordinary synthetic
users with one identity each, so flipping one membership bit substitutes one user and
the population keeps its size. That is the neighbouring relation of the accountant's
user-level guarantee (replace one user), so the audit's lower bound and the ledger's ε
speak about the same thing. Held-out identities (never in training) give the training
job its evaluation records.

Identity layout in the synthetic dataset (one identity per user): canary i is identity
i, filler i is identity `canaries + i`, held-out identity j is `2 * canaries + j`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from beam_jobs import partition_job, synthetic


@dataclasses.dataclass(frozen=True)
class CanaryPopulation:
    """Sizes and seeds of an audit population.

    Attributes:
      canaries: m, the number of membership bits (and of training users).
      held_out_identities: evaluation identities, never in training.
      images_per_identity: images of every canary, filler and held-out identity.
      image_size: synthetic image side (grayscale).
      data_seed: the synthetic dataset's seed (which identities look how).
      membership_seed: seeds the canaries' inclusion draw.
    """

    canaries: int
    held_out_identities: int = 8
    images_per_identity: int = 8
    image_size: int = 28
    data_seed: int = 0
    membership_seed: int = 0

    def __post_init__(self) -> None:
        if self.canaries < 2:
            raise ValueError(f"an audit needs at least 2 canaries, got {self.canaries}")
        if self.held_out_identities < 2:
            raise ValueError(
                f"evaluation needs at least 2 held-out identities, got {self.held_out_identities}"
            )

    @property
    def synthetic_config(self) -> synthetic.SyntheticConfig:
        return synthetic.SyntheticConfig(
            identities=2 * self.canaries + self.held_out_identities,
            images_per_identity=self.images_per_identity,
            image_size=self.image_size,
            seed=self.data_seed,
        )

    def membership(self) -> np.ndarray:
        """S: True where canary i is in training (probability 1/2 each, seeded)."""
        return (
            np.random.default_rng([self.membership_seed, self.canaries]).random(self.canaries) < 0.5
        )

    def training_identities(self) -> list[int]:
        """Synthetic identity index of each slot's user: the canary or its filler."""
        return [
            i if included else self.canaries + i for i, included in enumerate(self.membership())
        ]

    def _images(self, first_identity: int) -> list[list[bytes]]:
        config = self.synthetic_config
        return [
            [r.image for r in synthetic.records_for_identities(config, i, i + 1)]
            for i in range(first_identity, first_identity + self.canaries)
        ]

    def canary_images(self) -> list[list[bytes]]:
        """Encoded images of every canary, included or not (the auditor knows them)."""
        return self._images(0)

    def filler_images(self) -> list[list[bytes]]:
        """Encoded images of every filler user, in slot order (the auditor knows them)."""
        return self._images(self.canaries)


@dataclasses.dataclass(frozen=True)
class PopulationFiles:
    partition_dir: str
    eval_dir: str


def write_population(
    population: CanaryPopulation, out_dir: str, beam_args: list[str] | None = None
) -> PopulationFiles:
    """Writes the training partition (canaries or fillers) and held-out records."""
    config = population.synthetic_config
    training = (
        record
        for identity in population.training_identities()
        for record in synthetic.records_for_identities(config, identity, identity + 1)
    )
    held_out = synthetic.records_for_identities(config, 2 * population.canaries, config.identities)
    partition_dir, eval_dir = partition_job.write_training_inputs(
        out_dir, training, held_out, beam_args=beam_args
    )
    return PopulationFiles(partition_dir, eval_dir)
