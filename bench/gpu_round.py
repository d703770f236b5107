"""Device check for docs/scaling.md, "Accelerators": which training paths use a GPU.

Not yet run on a GPU (no session so far had one). Run it where this project's environment
sees one (TensorFlow with its CUDA 11.8 libraries: docs/scaling.md, "Accelerators"):

    python -m bench.gpu_round OUT.json [--quick]

The parent writes the synthetic data once and runs the same measurements in two child
processes, one with CUDA_VISIBLE_DEVICES="" (CPU only) and one with the machine's GPUs
visible: TensorFlow decides once per process which devices it has, so each setting needs
its own. Each child starts its own TFF worker and records:
- the devices its TensorFlow sees, and whether the CUDA driver library is mapped into
  it and into its TFF `worker_binary` (/proc/PID/maps);
- three jobs of `bench_transfer`'s rows, through `train_job.run_train_job` (the product
  path): the default DP-FedEmb recipe and the embedding-only cached one (TFF rounds, each
  on both executors, `runtime.executor` worker and in_process), the default recipe on
  MobileNetV2 at 112 px (in_process, `bench.executor_round.mobilenet_row`), and
  dp-sgd-centralized (the step loop, in the child itself); per job the median round
  seconds (the first round, which traces, left out), wall seconds and the cache's build,
  and for in_process the devices its client work ran on;
- a digest of one DP noise draw made as user-level DP-SGD makes it
  (`stateless_fold_in` of the step's seed, then `stateless_normal`), so that the two
  children's digests tell whether a GPU draws the same noise bits as the CPU.
OUT.json holds both children's figures and the GPU / CPU ratio of each job's median round
(a TFF row's per executor: "<row> [worker]", "<row> [in_process]").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

from bench import run_all  # no TensorFlow

# bench_transfer's rows this check times (its DEFAULT, EMBEDDING + CACHED and
# DP_SGD_CENTRALIZED; spelled out so that the parent imports no TensorFlow): two TFF
# jobs and one step-loop job.
ROWS = (
    "dp-fedemb default (conv+gn)",
    "dp-fedemb embedding cached",
    "dp-sgd-centralized",
)
# The TFF rows, timed on each executor (`runtime.RuntimeConfig.executor`).
TFF_ROWS = ROWS[:2]
EXECUTORS = ("worker", "in_process")
MOBILENET_ROW = "dp-fedemb mobilenet_v2 112px default"
# bench_transfer's quick sizes, with a round of the default recipe's 12 virtual clients
# of 8 users, a few rounds to take a median of, and DP-SGD steps of as many users.
_DEVICE_SIZES = {
    "identities": 200,
    "rounds": 4,
    "virtual_clients_per_round": 12,
    "dp_sgd_steps": 5,
    "dp_sgd_users": 96,
}
_NOISE_SEED = (1, 7)  # (noise seed, step), as the training loop (`jobs/loop.py`) passes them
_NOISE_PARAMETERS = 100_000


def _mapped_cuda_driver(pid: int | str) -> bool:
    """Whether process `pid` has the CUDA driver library (libcuda) mapped."""
    with open(f"/proc/{pid}/maps") as maps:
        return "libcuda.so" in maps.read()


def _noise_digest() -> str:
    import numpy as np
    import tensorflow as tf

    seed = tf.constant(_NOISE_SEED, tf.int64)
    noise = tf.random.stateless_normal(
        [_NOISE_PARAMETERS], tf.random.experimental.stateless_fold_in(seed, 0)
    )
    return hashlib.sha256(np.asarray(noise.numpy()).tobytes()).hexdigest()


def _sizes(quick: bool) -> dict:
    from bench import bench_transfer

    return dict(bench_transfer.QUICK) if quick else {**bench_transfer.QUICK, **_DEVICE_SIZES}


def _child(spec: dict) -> dict:
    import tensorflow as tf

    from bench import bench_transfer, executor_round
    from tff_algorithms.federated import dropouts, in_process_executor, runtime
    from tff_algorithms.jobs import train_job

    gpus = tf.config.list_physical_devices("GPU")
    jobs, unavailable = bench_transfer.configs(_sizes(spec["quick"]))
    planned = [(f"{name} [{e}]", name, e) for name in TFF_ROWS for e in EXECUTORS]
    planned += [(name, name, "worker") for name in ROWS if name not in TFF_ROWS]
    if spec.get("mobilenet_partition_dir"):
        jobs[MOBILENET_ROW] = executor_round.mobilenet_row(jobs[TFF_ROWS[0]])
        planned.append((f"{MOBILENET_ROW} [in_process]", MOBILENET_ROW, "in_process"))
    rows: dict[str, dict] = {}
    with runtime.session(handle_signals=False) as tff_runtime:
        for label, name, executor in planned:
            if name not in jobs:
                rows[label] = {"failed": unavailable.get(name, "no such row")}
                continue
            work = os.path.join(spec["work"], label)
            data = (spec["partition_dir"], spec["eval_dir"])
            if name == MOBILENET_ROW:
                data = (spec["mobilenet_partition_dir"], spec["mobilenet_eval_dir"])
            try:
                result = train_job.run_train_job(
                    jobs[name],
                    *data,
                    work,
                    runtime_config=runtime.RuntimeConfig(executor=executor),
                )
            except (dropouts.RoundBelowMinimumReports, ValueError) as error:  # still a result
                rows[label] = {"failed": str(error)}
                continue
            described = bench_transfer._describe(result)
            rows[label] = {
                key: described[key]
                for key in (
                    "rounds",
                    "rounds_are",
                    "wall_seconds",
                    "first_round_seconds",
                    "median_round_seconds",
                    "feature_cache",
                )
            }
            if executor == "in_process":
                compiled = in_process_executor.compiled_rounds()[-1]
                rows[label]["client_devices"] = [graph.device for graph in compiled.work]
                rows[label]["compile_seconds"] = compiled.compile_seconds
        workers_map_cuda = [_mapped_cuda_driver(w.process.pid) for w in tff_runtime.local_workers]
    figures = {
        "tensorflow": tf.__version__,
        "built_with_cuda": tf.test.is_built_with_cuda(),
        "gpus": [gpu.name for gpu in gpus],
        "tensor_float_32": tf.config.experimental.tensor_float_32_execution_enabled(),
        "driver_maps_cuda": _mapped_cuda_driver("self"),
        "tff_workers_map_cuda": workers_map_cuda,
        "noise_sha256": _noise_digest(),
        "rows": rows,
    }
    if gpus:
        figures["gpu_peak_bytes"] = tf.config.experimental.get_memory_info("GPU:0")["peak"]
    return figures


def _run_child(spec: dict, env: dict[str, str], out_path: str) -> dict:
    spec_path = f"{out_path}.spec.json"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    subprocess.run(
        [sys.executable, "-m", "bench.gpu_round", "--child", spec_path, out_path],
        check=True,
        env=env,
    )
    with open(out_path) as f:
        return json.load(f)


def run(out_json: str, quick: bool) -> dict:
    # The GPU child's environment is this one; the parent itself hides the GPUs before
    # TensorFlow loads, so that it holds no GPU memory while the children run.
    settings = {"cpu": {**os.environ, "CUDA_VISIBLE_DEVICES": ""}, "gpu": dict(os.environ)}
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from bench import bench_training

    sizes = _sizes(quick)
    work = tempfile.mkdtemp(prefix="gpu_round_")
    try:
        partition_dir, eval_dir = bench_training._write_data(
            work, sizes["identities"], sizes["images"]
        )
        mobilenet_dirs = bench_training._write_data(
            os.path.join(work, "mobilenet"), sizes["identities"], sizes["images"], 112
        )
        children = {}
        for device, env in settings.items():
            spec = {
                "quick": quick,
                "partition_dir": partition_dir,
                "eval_dir": eval_dir,
                "mobilenet_partition_dir": mobilenet_dirs[0],
                "mobilenet_eval_dir": mobilenet_dirs[1],
                "work": os.path.join(work, device),
            }
            children[device] = _run_child(spec, env, os.path.join(work, f"{device}.json"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cpu, gpu = children["cpu"], children["gpu"]
    ratios = {}
    for name in cpu["rows"]:
        cpu_row, gpu_row = cpu["rows"][name], gpu["rows"].get(name, {})
        if "median_round_seconds" in cpu_row and "median_round_seconds" in gpu_row:
            ratios[name] = gpu_row["median_round_seconds"] / cpu_row["median_round_seconds"]
    report = {
        "quick": quick,
        "sizes": dict(sizes),
        "gpu_seen": bool(gpu["gpus"]),
        "gpu_over_cpu_median_round": ratios,
        "same_noise_bits": cpu["noise_sha256"] == gpu["noise_sha256"],
        "machine": run_all.machine(),
        "children": children,
    }
    with open(out_json, "w") as f:
        json.dump(report, f, indent=2)
    return report


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--child"] and len(argv) == 3:
        with open(argv[1]) as f:
            spec = json.load(f)
        with open(argv[2], "w") as f:
            json.dump(_child(spec), f)
        return 0
    if len(argv) not in (1, 2) or argv[0].startswith("-") or argv[1:] not in ([], ["--quick"]):
        print("usage: python -m bench.gpu_round OUT.json [--quick]", file=sys.stderr)
        return 2
    report = run(argv[0], quick=argv[1:] == ["--quick"])
    print(json.dumps({k: v for k, v in report.items() if k != "children"}, indent=2))
    for device, child in report["children"].items():
        seconds = {n: r.get("median_round_seconds") for n, r in child["rows"].items()}
        print(f"{device}: gpus {child['gpus']}, median round seconds {seconds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
