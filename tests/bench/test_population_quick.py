"""The population benchmark's quick mode runs end to end through `bench.run_all` and writes
JSON of the documented shape (issue 41). Checks structure and the accounting's direction,
never timings or recalls."""

import json
import os

import pytest

from tests.bench import quick_run

# About four minutes on two shared cores: `make test-slow` (CI) runs it, `make test` does not.
# One xdist worker for the whole module, so its fixture (the benchmark) runs once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("bench_population_quick")]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    results_dir = str(tmp_path_factory.mktemp("bench_results"))
    quick_run.run_quick("bench_population", results_dir)
    with open(os.path.join(results_dir, "bench_population.json")) as f:
        population = json.load(f)
    population["plot_exists"] = os.path.getsize(os.path.join(results_dir, population["plot"])) > 0
    return population


def test_every_population_has_its_rows_scored_against_the_base(result):
    sizes = result["sizes"]
    names = {"hypothesis", "noiseless", *(f"epsilon {e:g}" for e in sizes["target_epsilons"])}
    assert list(result["rows"]) == [str(n) for n in sizes["populations"]]
    base = f"{sizes['populations'][0]}"
    for population, rows in result["rows"].items():
        assert set(rows) == names
        for name, row in rows.items():
            assert row["training_users"] == int(population)
            assert set(row["recall_at_far"]) == {"0.001", "0.01", "0.1"}
            paired = row["paired_minus_reference"]
            assert (paired is None) == (population == base and name == "hypothesis")
            assert row["peak_rss_bytes_process_tree"] > 0
    assert result["plot_exists"]


def test_the_hypothesis_keeps_the_noise_on_the_average_and_epsilon_falls(result):
    sizes = result["sizes"]
    hypothesis = [result["rows"][str(n)]["hypothesis"] for n in sizes["populations"]]
    noise = {round(row["noise_std_on_average_over_clip"], 12) for row in hypothesis}
    assert len(noise) == 1
    epsilons = [row["epsilon"] for row in hypothesis]
    assert all(a > b for a, b in zip(epsilons, epsilons[1:])), epsilons
    assert result["hypothesis_epsilon_falls_with_n"] is True
    # The accounting rows continue the same schedule beyond the trained populations.
    accounted = [result["accounting"][str(n)]["epsilon"] for n in sizes["accounting_populations"]]
    assert epsilons[-1] > accounted[0] > accounted[-1]


def test_target_rows_cost_their_target_and_noiseless_costs_no_epsilon(result):
    for rows in result["rows"].values():
        assert rows["noiseless"]["noise_multiplier"] == 0.0
        for epsilon in result["sizes"]["target_epsilons"]:
            row = rows[f"epsilon {epsilon:g}"]
            assert row["noise_source"] == "calibrated"
            assert 0.99 * epsilon <= row["epsilon"] <= epsilon


def test_two_workers_and_the_crossing_are_reported(result):
    assert sorted(result["two_workers"]) == sorted(
        str(n) for n in result["sizes"]["two_worker_populations"]
    )
    crossing = result["epsilon_2_crossing"]
    assert crossing["how"] in (
        "measured",
        "extrapolated",
        "beyond the accounting rows",
        "not enough positive drops to fit",
    )
