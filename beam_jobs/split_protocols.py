"""The split protocol: split names, split modes and the pure assignment of an identity
or a user to a split (docs/design.md section 3). It imports no Beam and no TensorFlow,
so configuration checks, texts and the evaluation read it without either; the Beam job
that applies it to records is `beam_jobs.splits`.

Each identity or user goes to a split by a keyed hash of (seed, name), so the assignment
needs no global state and is the same on every worker and run. Which is hashed depends on
`SplitConfig.mode`, one of the evaluation protocols of the paper's benchmarks (Table 3):

identity_and_user (faces: one identity per user): each identity goes to a split; a user
  goes to the most protected split among their identities' splits (test, then
  validation, then train, then public) and keeps only the records whose identity is in
  that split; the rest are dropped and counted. Evaluation identities and their users
  never appear in training; no user and no identity is in two splits.
identity (EMNIST: every writer writes every character): each identity goes to a split
  and every record goes to its identity's split, so a user can be in training with some
  identities and in evaluation with others; evaluation identities never appear in
  training. Nothing is dropped.
held_out_images (landmarks, species: photographers share them): each user goes to a split
  with all their records, so evaluation users never appear in training; evaluation is
  on their images of identities the training users hold too (records of identities no
  training user holds are dropped and counted). Its evaluation counts a pair of images of
  one identity as genuine only when two different users took them
  (tff_algorithms.evaluation.metrics, genuine pairs across users).
auto: identity_and_user when no identity is held by two users; otherwise
  `beam_jobs.splits.run_split` stops with one line naming the modes and the records each
  would keep.

`public_fraction` moves whole users to the public split (for non-private pretraining) in
every mode: in identity_and_user as the users of public identities, in the other modes
by a hash of the user. A user holding any private record never has a record in the public
split; in identity mode a public user's records of evaluation identities go to their
evaluation split (evaluation identities stay apart from all training, public included).

A split that would drop more than `max_dropped_fraction` of the private records stops
(`SplitRefused`, raised by `beam_jobs.splits.run_split` after writing the summary):
silently training on a sliver of the data is the failure this guards against.

Public data usually comes from elsewhere (the paper pretrains on ImageNet, a different
domain from the private users' faces): records from separate public sources go whole to
the public split, grouped apart from the private sources' users, so a public record
never moves a private user and a private record never becomes public. Their user and
identity names get the prefix `PUBLIC_SOURCE_PREFIX`: names from separate sources are
unrelated, and unprefixed they could collide with private ones (which dedup, rightly,
refuses as a split that is not disjoint).

Evaluation data may come from elsewhere too (mode held_out_images only, where a data set
such as TFF's Landmarks ships its own test split): with `evaluation_inputs` the records
of separate evaluation sources go to the test split and nowhere else (the private users
then fill train and validation: `test_fraction` must be 0). Their user names get the
prefix `EVALUATION_SOURCE_PREFIX`, their identities stay as they are (the protocol
evaluates training identities), and those of identities no training user holds are
dropped and counted apart (`evaluation_unseen_identity`), outside the private drop guard.
"""

import dataclasses
import hashlib

TRAIN = "train"
VALIDATION = "validation"
TEST = "test"
PUBLIC = "public"
# Most protected first: a user with identities in several splits goes to the first.
SPLIT_PRIORITY = (TEST, VALIDATION, TRAIN, PUBLIC)
EVALUATION_SPLITS = (VALIDATION, TEST)
# Names of records from separate public sources, in the public split.
PUBLIC_SOURCE_PREFIX = "public:"
# User names of records from separate evaluation sources, in the test split.
EVALUATION_SOURCE_PREFIX = "evaluation:"

IDENTITY_AND_USER = "identity_and_user"
IDENTITY = "identity"
HELD_OUT_IMAGES = "held_out_images"
AUTO = "auto"
MODES = (IDENTITY_AND_USER, IDENTITY, HELD_OUT_IMAGES)


@dataclasses.dataclass(frozen=True)
class Protocol:
    """What a split mode means, in the words the privacy text, report and model card use."""

    evaluation: str  # which records are evaluated
    outside_guarantee: str  # whose records the private training never touches
    recall_measures: str  # what recall@FAR of the evaluation measures
    # Dedup's id kinds ("user", "identity") that may be on both sides of train vs
    # evaluation, and of public vs private, in this mode.
    shared_across_splits: tuple[str, ...]
    shared_with_public: tuple[str, ...]


PROTOCOLS = {
    IDENTITY_AND_USER: Protocol(
        evaluation="held-out identities and their users, none of them in training",
        outside_guarantee=(
            "evaluation users' records are never trained on; a user holding identities of "
            "several splits keeps only those of the most protected one (the rest are dropped)"
        ),
        recall_measures="how well the model tells apart identities and users it never saw",
        shared_across_splits=(),
        shared_with_public=(),
    ),
    IDENTITY: Protocol(
        evaluation=(
            "held-out identities; their users may be training users (with other identities)"
        ),
        outside_guarantee=(
            "each user's records of evaluation identities are never trained on; the "
            "guarantee covers their training records, and the evaluation measures the model "
            "on users it was trained on"
        ),
        recall_measures=(
            "how well the model tells apart identities it never saw, written or taken by "
            "users it may have trained on"
        ),
        shared_across_splits=("user",),
        # Public users hold training identities, and their evaluation identities' records
        # are in the evaluation splits.
        shared_with_public=("user", "identity"),
    ),
    HELD_OUT_IMAGES: Protocol(
        evaluation="held-out users' images of identities the training users hold too",
        outside_guarantee=(
            "evaluation users' records are never trained on; the identities they show are "
            "training identities"
        ),
        recall_measures=(
            "how well the model recognises training identities in images of users it never "
            "saw (genuine pairs: two images of one identity by two different evaluation users; "
            "impostor pairs: any two images of different identities)"
        ),
        shared_across_splits=("identity",),
        shared_with_public=("identity",),
    ),
}


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Fractions per split (of identities or users, by `mode`); train takes the rest.

    public_inputs: records from separate public sources are given too (they all go
    to the public split, which then exists even when public_fraction is 0).
    max_dropped_fraction: `run_split` stops when the split would drop more than this
    share of the private records.
    """

    validation_fraction: float = 0.1
    test_fraction: float = 0.1
    public_fraction: float = 0.0
    seed: int = 0
    public_inputs: bool = False
    mode: str = IDENTITY_AND_USER
    max_dropped_fraction: float = 0.1
    evaluation_inputs: bool = False

    def __post_init__(self) -> None:
        fractions = (self.validation_fraction, self.test_fraction, self.public_fraction)
        if any(f < 0 for f in fractions) or sum(fractions) >= 1.0:
            raise ValueError(
                f"split fractions must be >= 0 and leave room for train, got {fractions}"
            )
        if self.mode not in (AUTO, *MODES):
            raise ValueError(
                f"split mode must be one of {', '.join((AUTO, *MODES))}, got {self.mode!r}"
            )
        if not 0.0 <= self.max_dropped_fraction <= 1.0:
            raise ValueError(
                f"max dropped fraction must be in [0, 1], got {self.max_dropped_fraction}"
            )
        if self.evaluation_inputs and self.mode != HELD_OUT_IMAGES:
            raise ValueError(
                f"evaluation inputs need split mode {HELD_OUT_IMAGES} (their images are of "
                f"training identities), got {self.mode!r}"
            )
        if self.evaluation_inputs and self.test_fraction:
            raise ValueError(
                "with evaluation inputs the test split is theirs: the test fraction of the "
                f"private users must be 0, got {self.test_fraction}"
            )

    @property
    def splits(self) -> tuple[str, ...]:
        has_public = self.public_fraction > 0 or self.public_inputs
        present = {TRAIN, VALIDATION, TEST} | ({PUBLIC} if has_public else set())
        return tuple(s for s in SPLIT_PRIORITY if s in present)


class SplitRefused(ValueError):
    """A split that would drop more than `max_dropped_fraction` of the private records,
    or mode auto on data whose users share identities."""


def _unit_interval(seed: int, key: str) -> float:
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _band(seed: int, key: str, bands: tuple[tuple[str, float], ...]) -> str:
    u = _unit_interval(seed, key)
    for split, fraction in bands:
        if u < fraction:
            return split
        u -= fraction
    return TRAIN


def identity_split(identity: str, config: SplitConfig) -> str:
    """The split of an identity (modes identity_and_user and identity): a pure function
    of (seed, identity). Only identity_and_user gives identities to the public split."""
    bands = ((TEST, config.test_fraction), (VALIDATION, config.validation_fraction))
    if config.mode in (IDENTITY_AND_USER, AUTO):
        bands += ((PUBLIC, config.public_fraction),)
    return _band(config.seed, identity, bands)


def user_split(user_id: str, config: SplitConfig) -> str:
    """The split of a user (modes identity and held_out_images): a pure function of
    (seed, user). In identity mode it says only whether the user is public."""
    bands = ((PUBLIC, config.public_fraction),)
    if config.mode == HELD_OUT_IMAGES:
        bands = ((TEST, config.test_fraction), (VALIDATION, config.validation_fraction), *bands)
    # Keyed apart from identities: a user and an identity of one name hash independently.
    return _band(config.seed, "user\x00" + user_id, bands)
