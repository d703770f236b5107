"""The virtual-client schedule: which users form virtual client j of round r.

The schedule is a pure function of (number of users, seed, round): users are indices into
a canonical user-id sequence (beam_jobs.partition.PartitionReader.user_ids() gives it,
sorted), and every round draws from a counter-based generator (Philox keyed by
SeedSequence([seed, stream, round])), so any round is computed without the previous ones
and costs O(users per round) (epoch mode: one O(N) permutation, cached).

Modes:
- "sampled" (DP-FedEmb, DP-FedAvg): each round samples users_per_round users uniformly
  without replacement and groups them into virtual clients of k users.
- "epoch" (DP-FTRL-FedEmb): one fixed permutation of users; round r takes the slice
  r mod rounds_per_epoch of it, so each user participates at most once per epoch and
  consecutive participations are exactly rounds_per_epoch rounds apart (the min
  separation the tree accountant assumes; reshuffling each epoch would break it). The
  grouping into virtual clients within a round is redrawn every round.
- "fixed": virtual clients are fixed groups of k users (one permutation, chunked); each
  round samples virtual_clients_per_round groups uniformly without replacement. The
  privacy unit is then the group.

No user is ever in two virtual clients of one round. ParticipationStats summarises what
the privacy accountant needs. It is a function of the counts alone (`ScheduleShape`, no
seed), so it can be computed and published by a step that never sees the seed, whose
secrecy the sampling amplification relies on.
"""

import dataclasses
import functools
import json
import math
from collections.abc import Sequence

import numpy as np

SAMPLED = "sampled"
EPOCH = "epoch"
FIXED = "fixed"
MODES = (SAMPLED, EPOCH, FIXED)

# Independent random streams per purpose, so e.g. the grouping never correlates with
# the sampling of the same round.
_SAMPLE_STREAM = 1
_ORDER_STREAM = 2
_GROUPING_STREAM = 3


def _generator(seed: int, stream: int, *counter: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, stream, *counter])))


@functools.lru_cache(maxsize=4)
def _fixed_order(seed: int, num_users: int) -> np.ndarray:
    order = _generator(seed, _ORDER_STREAM).permutation(num_users)
    order.flags.writeable = False  # shared by the cache
    return order


@dataclasses.dataclass(frozen=True)
class ParticipationStats:
    """What the privacy accountant needs to know about a schedule over `rounds` rounds.

    sampling_units / units_per_round: the population and per-round draw of the sampling
    (users for "sampled" and "epoch", fixed virtual clients for "fixed").
    max_participations / min_separation: bounds for any single user over the rounds;
    min_separation counts the rounds strictly between two participations (TF Privacy's
    tree-accounting convention, which tff_algorithms.privacy.accounting consumes).
    unscheduled_users: users the schedule never selects (remainders that do not fill an
    epoch slice or a fixed group).
    """

    mode: str
    users: int
    users_per_virtual_client: int
    virtual_clients_per_round: int
    users_per_round: int
    rounds: int
    rounds_per_epoch: int
    max_participations: int
    min_separation: int
    sampling_units: int
    units_per_round: int
    unscheduled_users: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict) -> "ParticipationStats":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(values)
        if missing:
            raise ValueError(f"participation statistics lack {sorted(missing)}")
        return cls(**{name: values[name] for name in names})

    @classmethod
    def from_json(cls, text: str) -> "ParticipationStats":
        return cls.from_dict(json.loads(text))


# A virtual_clients_per_round resolved from the population: the largest it fills.
AUTO = "auto"


def selected_per_round(virtual_clients_per_round: int, over_selection: float = 0.0) -> int:
    """The virtual clients a round selects when planning M and over-selecting by o:
    ceil(M (1 + o)). The rounding guard keeps e.g. 10 * 1.1 at 11, not 12."""
    return math.ceil(virtual_clients_per_round * (1 + over_selection) - 1e-9)


def trained_shape(
    num_users: int,
    users_per_virtual_client: int,
    virtual_clients_per_round: int | str,
    mode: str,
    over_selection: float = 0.0,
) -> "ScheduleShape":
    """The schedule a job trains with, the one source of it: the partition's published
    participation statistics, the training selection and the accountant's sampling all
    come from here. Its rounds select `selected_per_round` virtual clients (more than
    the planned M when over-selecting: every selected user may contribute, so the
    published and accounted schedule is the selected one). M may be AUTO."""
    planned = virtual_clients_per_round
    if planned == AUTO:
        planned = largest_virtual_clients_per_round(
            num_users, users_per_virtual_client, over_selection
        )
    return ScheduleShape(
        num_users,
        users_per_virtual_client,
        selected_per_round(int(planned), over_selection),
        mode,
    )


def largest_virtual_clients_per_round(
    num_users: int, users_per_virtual_client: int, over_selection: float = 0.0
) -> int:
    """The largest M whose round, over-selected to ceil(M (1 + over_selection)) virtual
    clients of `users_per_virtual_client` users, `num_users` users fill."""
    groups = num_users // users_per_virtual_client
    if groups < 1:
        raise ValueError(
            f"{num_users} training users cannot fill one virtual client of "
            f"{users_per_virtual_client} users: set users_per_virtual_client to at most "
            f"{num_users}, or train on more users"
        )
    largest = math.floor(groups / (1 + over_selection) + 1e-9)
    while largest >= 1 and selected_per_round(largest, over_selection) > groups:
        largest -= 1
    if largest < 1:
        raise ValueError(
            f"{num_users} training users cannot fill one round over-selected by "
            f"{over_selection:g}: set over_selection or users_per_virtual_client lower, or "
            "train on more users"
        )
    return largest


@dataclasses.dataclass(frozen=True)
class ScheduleShape:
    """The counts of a schedule without its seed: all its participation statistics need.

    Publishing a shape reveals nothing about which users a round takes.
    """

    num_users: int
    users_per_virtual_client: int
    virtual_clients_per_round: int
    mode: str = SAMPLED

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"schedule mode must be one of {MODES}, got {self.mode!r}")
        if self.users_per_virtual_client < 1 or self.virtual_clients_per_round < 1:
            raise ValueError("users per virtual client and virtual clients per round must be >= 1")
        if self.num_users < self.users_per_round:
            largest = self.num_users // self.users_per_virtual_client
            fix = (
                f"set virtual_clients_per_round to at most {largest} (or auto)"
                if largest
                else f"set users_per_virtual_client to at most {self.num_users}"
            )
            raise ValueError(
                f"{self.num_users} training users cannot fill a round of "
                f"{self.virtual_clients_per_round} virtual clients x "
                f"{self.users_per_virtual_client} users ({self.users_per_round}): {fix}, "
                "or train on more users"
            )

    @property
    def users_per_round(self) -> int:
        return self.users_per_virtual_client * self.virtual_clients_per_round

    @property
    def num_groups(self) -> int:
        """Fixed virtual clients ("fixed" mode): whole groups of k users."""
        return self.num_users // self.users_per_virtual_client

    @property
    def rounds_per_epoch(self) -> int:
        if self.mode == FIXED:
            return self.num_groups // self.virtual_clients_per_round
        return self.num_users // self.users_per_round

    def participation_stats(self, rounds: int) -> ParticipationStats:
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        if self.mode == EPOCH:
            max_participations = math.ceil(rounds / self.rounds_per_epoch)
            # The fixed order puts a user's participations rounds_per_epoch apart.
            min_separation = self.rounds_per_epoch - 1
            unscheduled = self.num_users - self.rounds_per_epoch * self.users_per_round
        else:
            # Uniform sampling bounds nothing: a user may be drawn every round.
            max_participations, min_separation = rounds, 0
            unscheduled = (
                self.num_users - self.num_groups * self.users_per_virtual_client
                if self.mode == FIXED
                else 0
            )
        if self.mode == FIXED:
            sampling_units, units_per_round = self.num_groups, self.virtual_clients_per_round
        else:
            sampling_units, units_per_round = self.num_users, self.users_per_round
        return ParticipationStats(
            mode=self.mode,
            users=self.num_users,
            users_per_virtual_client=self.users_per_virtual_client,
            virtual_clients_per_round=self.virtual_clients_per_round,
            users_per_round=self.users_per_round,
            rounds=rounds,
            rounds_per_epoch=self.rounds_per_epoch,
            max_participations=max_participations,
            min_separation=min_separation,
            sampling_units=sampling_units,
            units_per_round=units_per_round,
            unscheduled_users=unscheduled,
        )


@dataclasses.dataclass(frozen=True)
class VirtualClientSchedule:
    """A `ScheduleShape` plus the seed that draws its rounds (keep the seed secret)."""

    num_users: int
    users_per_virtual_client: int
    virtual_clients_per_round: int
    seed: int
    mode: str = SAMPLED

    def __post_init__(self) -> None:
        _ = self.shape  # checks the counts
        if self.seed < 0:
            raise ValueError(f"schedule seed must be >= 0, got {self.seed}")

    @property
    def shape(self) -> ScheduleShape:
        return ScheduleShape(
            self.num_users, self.users_per_virtual_client, self.virtual_clients_per_round, self.mode
        )

    @property
    def users_per_round(self) -> int:
        return self.shape.users_per_round

    @property
    def num_groups(self) -> int:
        return self.shape.num_groups

    @property
    def rounds_per_epoch(self) -> int:
        return self.shape.rounds_per_epoch

    def epoch_of_round(self, round_num: int) -> int:
        return round_num // self.rounds_per_epoch

    def round_user_indices(self, round_num: int, attempt: int = 0) -> np.ndarray:
        """User indices of round `round_num` as an int64 array [virtual clients, k].

        `attempt` > 0 is a retry of the round (too few virtual clients reported): a
        fresh draw from its own counter (seed, stream, round, attempt). In epoch mode
        the retry keeps the round's users (the tree accounting's participation bounds
        rely on the fixed order) and redraws only their grouping.
        """
        if round_num < 0 or attempt < 0:
            raise ValueError(f"round and attempt must be >= 0, got {round_num}, {attempt}")
        m, k = self.virtual_clients_per_round, self.users_per_virtual_client
        # Attempt 0 keeps the counter of a schedule without retries.
        counter = (round_num,) if attempt == 0 else (round_num, attempt)
        if self.mode == SAMPLED:
            # choice(replace=False) is O(users_per_round) for small draws and returns the
            # sample in random order, so consecutive chunks are random virtual clients.
            users = _generator(self.seed, _SAMPLE_STREAM, *counter).choice(
                self.num_users, self.users_per_round, replace=False
            )
            return users.astype(np.int64).reshape(m, k)
        order = _fixed_order(self.seed, self.num_users)
        if self.mode == EPOCH:
            slot = round_num % self.rounds_per_epoch
            users = order[slot * self.users_per_round : (slot + 1) * self.users_per_round]
            regroup = _generator(self.seed, _GROUPING_STREAM, *counter).permutation(
                self.users_per_round
            )
            return users[regroup].astype(np.int64).reshape(m, k)
        groups = _generator(self.seed, _SAMPLE_STREAM, *counter).choice(
            self.num_groups, m, replace=False
        )
        members = groups[:, None] * k + np.arange(k)[None, :]
        return order[members].astype(np.int64)

    def virtual_client_user_indices(self, round_num: int, virtual_client: int) -> np.ndarray:
        if not 0 <= virtual_client < self.virtual_clients_per_round:
            raise ValueError(
                f"virtual client must be in [0, {self.virtual_clients_per_round}), got {virtual_client}"
            )
        return self.round_user_indices(round_num)[virtual_client]

    def participation_stats(self, rounds: int) -> ParticipationStats:
        return self.shape.participation_stats(rounds)


def virtual_clients_for_round(
    user_ids: Sequence[str],
    seed: int,
    round_num: int,
    users_per_virtual_client: int,
    virtual_clients_per_round: int,
    mode: str = SAMPLED,
) -> list[list[str]]:
    """The schedule as a pure function: the user ids of each virtual client of a round.

    `user_ids` is the canonical order (the same sequence on every call).
    """
    schedule = VirtualClientSchedule(
        len(user_ids), users_per_virtual_client, virtual_clients_per_round, seed, mode
    )
    return [[user_ids[i] for i in group] for group in schedule.round_user_indices(round_num)]
