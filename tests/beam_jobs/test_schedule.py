"""The virtual-client schedule: coverage, disjointness, determinism, statistics."""

import math

import numpy as np
import pytest

from beam_jobs import schedule


@pytest.mark.parametrize("mode", schedule.MODES)
def test_no_user_twice_in_a_round_and_rounds_are_pure(mode):
    plan = schedule.VirtualClientSchedule(103, 3, 5, seed=7, mode=mode)
    for round_num in (0, 1, 17, 40):
        users = plan.round_user_indices(round_num)
        assert users.shape == (5, 3)
        assert len(np.unique(users)) == 15 and users.min() >= 0 and users.max() < 103
    # Any round is computed without the previous ones, identically every time.
    fresh = schedule.VirtualClientSchedule(103, 3, 5, seed=7, mode=mode)
    np.testing.assert_array_equal(fresh.round_user_indices(40), plan.round_user_indices(40))
    other_seed = schedule.VirtualClientSchedule(103, 3, 5, seed=8, mode=mode)
    assert not np.array_equal(other_seed.round_user_indices(40), plan.round_user_indices(40))


def test_epoch_mode_covers_every_user_exactly_once_per_epoch():
    plan = schedule.VirtualClientSchedule(60, 2, 5, seed=3, mode=schedule.EPOCH)
    assert plan.rounds_per_epoch == 6
    for epoch in range(3):
        rounds = [plan.round_user_indices(epoch * 6 + r).ravel() for r in range(6)]
        assert sorted(np.concatenate(rounds).tolist()) == list(range(60))
    stats = plan.participation_stats(rounds=20)
    assert (stats.max_participations, stats.min_separation, stats.unscheduled_users) == (4, 5, 0)


def test_epoch_mode_separation_and_remainder():
    plan = schedule.VirtualClientSchedule(64, 2, 5, seed=3, mode=schedule.EPOCH)
    rounds_of_user: dict[int, list[int]] = {}
    for round_num in range(30):
        for user in plan.round_user_indices(round_num).ravel():
            rounds_of_user.setdefault(int(user), []).append(round_num)
    assert len(rounds_of_user) == 60  # 4 users never fit a full round
    gaps = [b - a for rounds in rounds_of_user.values() for a, b in zip(rounds, rounds[1:])]
    assert min(gaps) == plan.rounds_per_epoch == plan.participation_stats(30).min_separation + 1
    assert (
        max(len(r) for r in rounds_of_user.values())
        == plan.participation_stats(30).max_participations
        == 5
    )


def test_fixed_mode_keeps_virtual_clients_across_rounds():
    plan = schedule.VirtualClientSchedule(50, 4, 3, seed=1, mode=schedule.FIXED)
    groups = {tuple(sorted(g)) for r in range(40) for g in plan.round_user_indices(r).tolist()}
    assert len(groups) <= plan.num_groups == 12
    members = [u for g in groups for u in g]
    assert len(members) == len(set(members))  # groups never overlap
    stats = plan.participation_stats(10)
    assert (stats.sampling_units, stats.units_per_round, stats.unscheduled_users) == (12, 3, 2)


def test_sampled_mode_is_uniform_enough():
    plan = schedule.VirtualClientSchedule(20, 2, 2, seed=0)
    counts = np.bincount(
        np.concatenate([plan.round_user_indices(r).ravel() for r in range(2000)]), minlength=20
    )
    assert counts.min() > 330 and counts.max() < 470  # expectation 400


def test_participation_stats_json_round_trip():
    stats = schedule.VirtualClientSchedule(3400, 8, 32, seed=0).participation_stats(200)
    assert schedule.ParticipationStats.from_json(stats.to_json()) == stats
    assert stats.users_per_round == 256 and stats.rounds_per_epoch == 13
    assert "seed" not in stats.to_json()
    with pytest.raises(ValueError, match="lack"):
        schedule.ParticipationStats.from_dict({"mode": "sampled"})


def test_named_user_ids_and_bad_parameters():
    ids = [f"user{i}" for i in range(10)]
    clients = schedule.virtual_clients_for_round(
        ids, seed=2, round_num=5, users_per_virtual_client=2, virtual_clients_per_round=3
    )
    assert len(clients) == 3 and all(len(c) == 2 for c in clients)
    assert len({u for c in clients for u in c}) == 6
    with pytest.raises(ValueError, match="cannot fill a round"):
        schedule.VirtualClientSchedule(5, 2, 3, seed=0)
    with pytest.raises(ValueError, match="mode"):
        schedule.VirtualClientSchedule(50, 2, 3, seed=0, mode="poisson")


def test_a_million_users():
    # Rounds cost O(users per round) (epoch/fixed: one cached permutation); timings live
    # in bench/, this only checks the large population works.
    for mode in schedule.MODES:
        plan = schedule.VirtualClientSchedule(1_000_000, 8, 64, seed=1, mode=mode)
        for round_num in (0, 999, 123_456):
            users = plan.round_user_indices(round_num)
            assert users.shape == (64, 8) and len(np.unique(users)) == 512


@pytest.mark.parametrize(
    "users, k, over_selection, expected",
    [(100, 8, 0.0, 12), (99, 8, 0.0, 12), (96, 8, 0.25, 9), (88, 8, 0.1, 10), (16, 8, 0.5, 1)],
)
def test_largest_virtual_clients_per_round_fills_the_selected_round(
    users, k, over_selection, expected
):
    largest = schedule.largest_virtual_clients_per_round(users, k, over_selection)
    assert largest == expected
    # Its selected round fits; one more virtual client's would not.
    selected = math.ceil(largest * (1 + over_selection) - 1e-9)
    assert selected * k <= users
    assert largest == 1 or math.ceil((largest + 1) * (1 + over_selection) - 1e-9) * k > users
    schedule.ScheduleShape(users, k, selected)


def test_a_population_smaller_than_one_virtual_client_names_the_setting():
    with pytest.raises(ValueError, match="set users_per_virtual_client to at most 5"):
        schedule.largest_virtual_clients_per_round(5, 8)
    with pytest.raises(ValueError, match="set over_selection or users_per_virtual_client lower"):
        schedule.largest_virtual_clients_per_round(8, 8, 0.5)
    with pytest.raises(ValueError, match="set virtual_clients_per_round to at most 2 .or auto."):
        schedule.ScheduleShape(20, 8, 3)
