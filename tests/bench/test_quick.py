"""The speed benchmark's quick mode runs end to end through `bench.run_all` and writes
JSON of the documented shape. Checks structure and exact counts, never timings."""

import json
import math
import os

import pytest

from tests.bench import quick_run

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
# One xdist worker for the whole module: its module fixture (minutes) is then built once,
# not once on each worker (tests/conftest.py leaves slow modules ungrouped).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("bench_quick")]


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    results_dir = str(tmp_path_factory.mktemp("bench_results"))
    quick_run.run_quick("bench_speed", results_dir)
    with open(os.path.join(results_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(results_dir, "bench_speed.json")) as f:
        speed = json.load(f)
    with open(os.path.join(results_dir, "speed_summary.json")) as f:
        speed["speed_summary_file"] = json.load(f)
    return summary, speed


def test_summary_names_the_machine(results):
    summary, speed = results
    machine = summary["machine"]
    assert machine["cpus"] >= 1 and machine["cpu_model"] and machine["memory_gib"] > 0
    assert len(machine["load_average_1_5_15"]) == 3
    assert list(summary["results"]) == ["bench_speed"]
    assert speed["machine"] == machine and speed["quick"] is True


def test_every_section_is_a_ratio_to_a_baseline_of_the_same_run(results):
    _, speed = results
    sizes = speed["sizes"]
    clients = sizes["clients_per_round"]
    overhead = speed["federation_overhead"]
    for ratios in (overhead["tff_over_plain"], overhead["tff_over_plain_cpu"]):
        assert sorted(ratios) == sorted(str(m) for m in clients)
        assert all(_positive(r) for r in ratios.values())
    per_example = sizes["users_per_virtual_client"] * sizes["images_per_user"]
    for setting, m in zip(overhead["settings"], clients, strict=True):
        # Every round trained exactly the scheduled users' examples, in TFF.
        assert setting["examples_per_round"] == m * per_example
        # The plain baseline's client function was traced once, not once per round.
        assert setting["plain_client_update_traces"] == 1
        assert _positive(setting["round_seconds"]["median"])
        assert _positive(setting["plain_round_seconds"]["median"])
        assert _positive(setting["round_cpu_seconds"]["median"])
        assert _positive(setting["plain_round_cpu_seconds"]["median"])
        assert setting["peak_rss_mib"]["workers"] > 0
        assert setting["load_average_1min"]["n"] == sizes["rounds"]
    scaling = speed["clients_per_round_scaling"]
    assert [row["clients_per_round"] for row in scaling] == clients
    assert scaling[0]["round_seconds_ratio"] == 1.0
    workers = speed["workers"]
    assert [s["local_workers"] for s in workers["settings"]] == [1, 2]
    assert (
        workers["settings"][1]["examples_per_round"] == workers["settings"][0]["examples_per_round"]
    )
    assert _positive(workers["two_over_one_round_seconds"])
    population = speed["population"]
    assert population["users"] == [sizes["users"], sizes["users"] * sizes["population_factor"]]
    for key in ("round_seconds_ratio", "peak_rss_total_ratio", "peak_rss_workers_ratio"):
        assert _positive(population[key])
    loader = population["loader"]
    assert loader["first"]["offset"] == 0 and loader["last"]["offset"] > 0
    assert loader["deep"]["offset"] == sizes["loader_deep_offset_bytes"]
    for name in ("first", "last", "deep"):
        assert _positive(loader[name]["seconds"])
        if loader[name]["bytes_read"] is not None:
            # The loader seeks: it reads about the user's bytes, not the part up to them.
            assert loader[name]["bytes_read"] < loader["deep"]["offset"]


def test_flop_count_of_the_profiler_matches_the_analytic_count(results):
    _, speed = results
    flops = speed["flops"]
    # Convolutions and matmuls dominate; the profiler also counts a few elementwise ops.
    assert 1.0 <= flops["profiler_over_analytic"] < 1.1
    assert flops["flops_per_example"] * flops["batch_size"] == flops["step_flops_profiler"]
    for key in ("peak_flops_per_s", "local_step_flops_per_s", "large_batch_step_flops_per_s"):
        assert _positive(flops[key])
    assert [row["clients_per_round"] for row in flops["achieved"]] == speed["sizes"][
        "clients_per_round"
    ]
    assert all(_positive(row["tff_over_peak"]) for row in flops["achieved"])


def test_speed_summary_holds_the_four_figures_of_one_run(results):
    _, speed = results
    written = speed["speed_summary_file"]
    rounds = speed["round_speed"]
    assert written == rounds["summary"] and written["quick"] is True
    for key in (
        "default_round_over_arithmetic",
        "cached_over_uncached_round",
        "tff_over_plain_round",
    ):
        assert _positive(written[key])
    assert isinstance(written["step_overhead_ms"], (int, float))
    medians = rounds["median_round_seconds"]
    assert sorted(medians) == ["default", "embedding_cached", "embedding_uncached", "plain"]
    sizes = written["sizes"]
    for values in rounds["round_seconds"].values():
        assert len(values) == sizes["rounds"]
    # The figures are the ratios of this run's own medians and arithmetic.
    default = rounds["arithmetic"]["default"]
    assert written["tff_over_plain_round"] == round(medians["default"] / medians["plain"], 3)
    assert written["default_round_over_arithmetic"] == round(
        medians["default"] / default["arithmetic_seconds_at_peak"], 3
    )
    # The cached row's local step differentiates the embedding layer alone.
    cached = rounds["arithmetic"]["embedding_cached"]
    assert (
        cached["local_step_flops"] < rounds["arithmetic"]["embedding_uncached"]["local_step_flops"]
    )
    assert default["local_steps_per_round"] == sizes["clients_per_round"] * 12
    # The plain program computes the TFF round: same steps, same shuffles, same clipping.
    # Threads sum in other orders, which 12 steps at CosFace scale 30 grow to 1e-5..3e-4;
    # batches in other orders (as before each pass had its own shuffle) gave 2e-3..7e-3.
    assert rounds["plain_vs_tff_max_abs_difference"] < 1e-3
    profile = rounds["profile"]
    assert profile["local_steps_per_client"] == 12
    assert all(_positive(profile[k]) for k in ("build_read_decode_once_ms", "client_update_ms"))
    # Kernel names as they ran: on a CPU where TensorFlow uses oneDNN the op is
    # "_MklNativeConv2DBackpropFilterWithBias", elsewhere "Conv2DBackpropFilter".
    assert any("Conv2DBackpropFilter" in op for op in rounds["step_op_ms"])
