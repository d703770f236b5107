"""The two executors side by side (issue 65, item 4): a DP-FedEmb round on TFF's
`worker_binary` (`runtime.executor` worker) and on TFF's MapReduceForm of the same
`next` run in the training process (in_process), in one run.

    python -m bench.executor_round OUT.json [--quick] [--mobilenet]

Rows (bench_transfer's jobs, through `train_job.run_train_job`, the product path): the
default recipe (conv and GroupNorm layers trained) and the embedding layer alone on
cached trunk features; `--mobilenet` adds MobileNetV2 at 112 px (its default recipe's
layers). Each row's job runs four times, worker, in_process, in_process, worker (so a
load that drifts during the run weighs on both alike), on the same data and seeds: the
same rounds. Per run: the median round after the first (the first compiles: TFF's
lowering for in_process, its native compiler and the worker's graph setup for worker),
the first round, wall and CPU seconds of the job (this process and the worker it
started); for in_process also TFF's compile time and where the last round's time went
(prepare, client work, aggregation, server update; `CompiledRound.last_round_seconds`).
The in_process / worker ratio of each row's median round is the mean of the two pairs'.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from bench import bench_training, bench_transfer, run_all

EXECUTORS = ("worker", "in_process")
ORDER = ("worker", "in_process", "in_process", "worker")
ROWS = (bench_transfer.DEFAULT, f"{bench_transfer.EMBEDDING} {bench_transfer.CACHED}")
MOBILENET = "dp-fedemb mobilenet_v2 112px default"
# The default recipe's round shape at a population this machine trains in minutes.
SIZES = {"identities": 200, "images": 4, "rounds": 4, "virtual_clients_per_round": 12}
QUICK_SIZES = {"identities": 60, "images": 4, "rounds": 3, "virtual_clients_per_round": 4}


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the stopped worker
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _jobs(quick: bool, mobilenet: bool) -> dict:
    sizes = {**bench_transfer.QUICK, **(QUICK_SIZES if quick else SIZES)}
    jobs, _ = bench_transfer.configs(sizes)
    rows = {name: dataclasses.replace(jobs[name], evaluate_every=0) for name in ROWS}
    if mobilenet:
        rows[MOBILENET] = mobilenet_row(rows[bench_transfer.DEFAULT])
    return {"sizes": sizes, "rows": rows}


def mobilenet_row(default: Any) -> Any:
    """The default recipe's job on MobileNetV2 at 112 px, training its last block and
    the embedding (`bench_training.MOBILENET_V2_TRUNK`'s layers)."""
    from tff_algorithms.config import model_config

    return dataclasses.replace(
        default,
        architecture=model_config.MOBILENET_V2,
        image_size=112,
        trainable_layers=("Conv_1", "Conv_1_bn", "embedding"),
    )


def _run(config, data: tuple[str, str], work: str, executor: str) -> dict:  # noqa: ANN001
    from tff_algorithms.federated import in_process_executor, runtime
    from tff_algorithms.jobs import train_job

    cpu, wall = _cpu_seconds(), time.perf_counter()
    result = train_job.run_train_job(
        config, *data, work, runtime_config=runtime.RuntimeConfig(executor=executor)
    )
    seconds = [r["round_seconds"] for r in result.metrics["history"] if r["round"] >= 1]
    figures = {
        "executor": executor,
        "first_round_seconds": seconds[0],
        "median_round_seconds": statistics.median(seconds[1:] or seconds),
        "round_seconds": seconds,
        "wall_seconds": time.perf_counter() - wall,
        "cpu_seconds": _cpu_seconds() - cpu,
        "epsilon": result.metrics["epsilon"],
    }
    if executor == "in_process":
        compiled = in_process_executor.compiled_rounds()[-1]
        figures["compile_seconds"] = compiled.compile_seconds
        figures["last_round_seconds"] = dict(compiled.last_round_seconds)
        figures["client_devices"] = [graph.device for graph in compiled.work]
    return figures


def run(out_json: str, quick: bool, mobilenet: bool) -> dict:
    planned = _jobs(quick, mobilenet)
    sizes = planned["sizes"]
    work = tempfile.mkdtemp(prefix="executor_round_")
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows: dict[str, dict] = {}
    try:
        data_by_size: dict[int, tuple[str, str]] = {}
        for name, config in planned["rows"].items():
            size = config.image_size
            if size not in data_by_size:
                data_by_size[size] = bench_training._write_data(
                    os.path.join(work, f"data{size}"), sizes["identities"], sizes["images"], size
                )
            runs = []
            for i, executor in enumerate(ORDER):
                out = os.path.join(work, f"{name}-{i}".replace(" ", "_"))
                runs.append(_run(config, data_by_size[size], out, executor))
                print(f"{name} {executor}: {runs[-1]['median_round_seconds']:.2f} s", flush=True)
            pairs = [(runs[0], runs[1]), (runs[3], runs[2])]
            rows[name] = {
                "runs": runs,
                "in_process_over_worker_median_round": statistics.mean(
                    b["median_round_seconds"] / a["median_round_seconds"] for a, b in pairs
                ),
                "in_process_over_worker_cpu": statistics.mean(
                    b["cpu_seconds"] / a["cpu_seconds"] for a, b in pairs
                ),
                "same_epsilon": len({r["epsilon"] for r in runs}) == 1,
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "quick": quick,
        "sizes": {k: sizes[k] for k in (*SIZES, "users_per_virtual_client") if k in sizes},
        # run_all's record of the machine (its load average at the end), and at the start.
        "machine": {**run_all.machine(), "load_average_1_5_15_start": load_start},
        "rows": rows,
    }
    with open(out_json, "w") as f:
        json.dump(report, f, indent=2)
    return report


def _main(argv: list[str]) -> int:
    options = set(argv[1:])
    if not argv or argv[0].startswith("-") or not options <= {"--quick", "--mobilenet"}:
        print(
            "usage: python -m bench.executor_round OUT.json [--quick] [--mobilenet]",
            file=sys.stderr,
        )
        return 2
    report = run(argv[0], "--quick" in options, "--mobilenet" in options)
    for name, row in report["rows"].items():
        print(
            f"{name}: in_process / worker median round "
            f"{row['in_process_over_worker_median_round']:.2f}, CPU "
            f"{row['in_process_over_worker_cpu']:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
