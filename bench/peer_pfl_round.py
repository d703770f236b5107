"""Against the best peer (issue 65, item 5): a dp-fedavg round of ours beside
pfl-research's FedAvg with central DP on the same work, wall and CPU per round as
ratios from interleaved runs.

    python -m bench.peer_pfl_round OUT.json [--quick] [--in-process] [--pfl-default-threads]
        [--check]

Needs `.venv-pfl` (`make peer-env`: pfl 0.6 and PyTorch in their own environment; the
product's lock has neither). The pfl side is `bench/peer_pfl_runner.py`, run in it.

The same work on both sides:
- one pfl user is one of our virtual clients, with that virtual client's examples (its
  k users' images, decoded once here; labels are rows of the global head), and pfl's
  user sampler hands out our schedule's virtual clients in our order, so every round
  trains the same clients on both sides;
- the small CNN (two 5x5 conv + GroupNorm blocks, a dense embedding) and the global head,
  from the same starting weights: ours as built by `models.build_backbone` and
  `models.initial_head_kernel` with the job's seed, moved into PyTorch's layout by
  `torch_layout` (tests/bench/test_peer_pfl_round.py checks that layout's forward pass
  against Keras');
- the same local work (local epochs, batch size, momentum SGD at the client learning
  rate, softmax cross-entropy), the same clip of the whole update, noise of std
  z x clip on the sum, the sum over the M planned clients, momentum SGD on the server.

Sides, run in turn (the order flips every repeat, so a load that drifts weighs on both
alike): ours is `train_job.run_train_job` on the `worker` executor (the default; and
`in_process` with `--in-process`), a round timed between two of the loop's progress
calls (its checkpoint and ledger included), CPU of this process and its workers; pfl
runs in its own process with PyTorch at one intra-op thread (`OMP_NUM_THREADS=1`,
`torch.set_num_threads(1)`), and with `--pfl-default-threads` also at PyTorch's default.
The first round (tracing, compiling; pfl's evaluation of the first cohort) and the last
(our held-out evaluation follows it) are left out; each run's figure is the median of
the rounds between, and a ratio is the median over repeats of ours / pfl.

`--check` first runs the same-work check (`same_work_check`): two rounds with no noise
and one local step per client, after which our trained backbone and pfl's must agree
to float32 rounding, far below how far the rounds moved it.

Accounting differs and the output says how: ours samples a fixed number of virtual
clients without replacement, neighbours substitute one user, sensitivity 2 x clip
(docs/privacy.md); pfl's accountants assume Poisson sampling, add-or-remove-one, and
sensitivity 1 x clip. pfl's convention's epsilon comes from pfl's own accountants
(PLD, PRV, RDP) at the per-user sampling rate M k / N, beside ours.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bench import bench_training, run_all

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PFL_PYTHON = os.path.join(REPO, ".venv-pfl", "bin", "python")
PFL_RUNNER = os.path.join(REPO, "bench", "peer_pfl_runner.py")
# Each pfl run is bounded; at the full sizes one takes well under a minute.
PFL_TIMEOUT_SECONDS = 900
NOISE_MULTIPLIER = 1.0
# A virtual client: 8 users of 4 images, 2 local epochs at batch 8 (8 local steps).
SIZES = {
    "identities": 300,
    "images": 4,
    "users_per_virtual_client": 8,
    "virtual_clients_per_round": 12,
    "local_epochs": 2,
    "rounds": 6,
    "repeats": 3,
}
QUICK_SIZES = {
    "identities": 60,
    "images": 4,
    "users_per_virtual_client": 2,
    "virtual_clients_per_round": 4,
    "local_epochs": 1,
    "rounds": 4,
    "repeats": 2,
}
# The same-work check (`same_work_check`): two rounds, one local step per client.
CHECK_SIZES = {**QUICK_SIZES, "rounds": 2, "repeats": 1}
OURS_ACCOUNTING = (
    "fixed-size sampling of virtual clients without replacement, substitute-one user "
    "neighbours, sensitivity 2 x clip (noise std z x clip)"
)
PFL_ACCOUNTING = (
    "Poisson sampling, add-or-remove-one user neighbours, sensitivity 1 x clip (noise std z x clip)"
)


def job_config(sizes: Mapping[str, int], *, seed: int = 0) -> Any:
    """The benchmark's dp-fedavg job: the small CNN at 28 px, fixed testing seeds."""
    from tff_algorithms.config import job_config as job_config_lib

    return job_config_lib.TrainJobConfig(
        algorithm=job_config_lib.DP_FEDAVG,
        rounds=sizes["rounds"],
        noise_multiplier=NOISE_MULTIPLIER,
        clip_norm=1.0,
        users_per_virtual_client=sizes["users_per_virtual_client"],
        virtual_clients_per_round=sizes["virtual_clients_per_round"],
        local_epochs=sizes["local_epochs"],
        batch_size=8,
        embedding_size=64,
        evaluate_every=0,
        seed=seed,
        schedule_seed=1,
        testing_fixed_schedule=True,
        noise_seed=2,
        testing_fixed_noise=True,
        cache_features=False,
    )


def torch_layout(
    names: Sequence[str], values: Sequence[np.ndarray], flatten_shape: tuple[int, int, int]
) -> dict[str, np.ndarray]:
    """The small CNN's Keras variables (`models.ordered_variables` order, with their
    names) as PyTorch parameters: conv kernels HWIO -> OIHW, the dense kernel
    [H*W*C, out] -> [out, C*H*W] (Keras flattens NHWC, PyTorch NCHW), GroupNorm's gamma
    and beta and every bias as they are. `flatten_shape` is (H, W, C) before Flatten."""
    out = {}
    for name, value in zip(names, values):
        layer, _, variable = name.rpartition("/")
        variable = variable.split(":")[0]
        value = np.asarray(value, np.float32)
        if variable == "kernel" and value.ndim == 4:
            out[f"{layer}.weight"] = np.ascontiguousarray(value.transpose(3, 2, 0, 1))
        elif variable == "kernel":
            height, width, channels = flatten_shape
            kernel = value.reshape(height, width, channels, -1).transpose(3, 2, 0, 1)
            out[f"{layer}.weight"] = np.ascontiguousarray(kernel.reshape(kernel.shape[0], -1))
        elif variable == "gamma":
            out[f"{layer}.weight"] = value
        elif variable in ("beta", "bias"):
            out[f"{layer}.bias"] = value
        else:
            raise ValueError(f"no PyTorch parameter for Keras variable {name}")
    return out


def backbone_in_torch_layout(backbone: Any) -> dict[str, np.ndarray]:
    """`torch_layout` of a built small CNN (`models.build_backbone`)."""
    from tff_algorithms.modeling import models

    variables = models.ordered_variables(backbone)
    flatten = next(layer for layer in backbone.layers if layer.name.startswith("flatten"))
    return torch_layout(
        [f"{v.name.split('/')[0]}/{v.name.split('/')[-1]}" for v in variables],
        [v.numpy() for v in variables],
        tuple(int(d) for d in flatten.input.shape[1:]),
    )


def export_work(config: Any, partition_dir: str, out_npz: str) -> dict:
    """Writes what the pfl side needs (module docstring) and returns its settings."""
    import tensorflow as tf

    from beam_jobs import partition
    from tff_algorithms.config import job_plan
    from tff_algorithms.federated import client_data
    from tff_algorithms.modeling import identity_heads, models

    reader = partition.PartitionReader(partition_dir)
    user_ids = reader.user_ids()
    plan = job_plan.schedule_for(config, len(user_ids), config.schedule_seed)
    ids = client_data.VirtualClientIds(partition_dir, plan, user_ids)
    vocabulary = identity_heads.training_identity_vocabulary(reader, user_ids)
    backbone = models.build_backbone(config.backbone_config, config.seed)
    head = models.initial_head_kernel(
        tf.constant([config.seed, -1], tf.int64), config.embedding_size, len(vocabulary)
    )
    arrays = {f"weight/{k}": v for k, v in backbone_in_torch_layout(backbone).items()}
    arrays["weight/head"] = head.numpy()
    schedule = []
    for t in range(config.rounds):
        for j, vc_id in enumerate(ids.for_round(t)):
            name = f"r{t}c{j}"
            batch = next(
                iter(
                    client_data.load_examples(tf.constant(vc_id), config.image_shape).batch(1 << 16)
                )
            )
            keys = identity_heads.identity_keys(batch["identity"]).numpy()
            arrays[f"images/{name}"] = np.ascontiguousarray(
                batch["image"].numpy().transpose(0, 3, 1, 2)
            )
            arrays[f"labels/{name}"] = np.searchsorted(vocabulary, keys).astype(np.int64)
            schedule.append(name)
    gn = [layer for layer in backbone.layers if layer.name in ("gn0", "gn1")]
    client = config.client_config()
    delta = config.delta if config.delta is not None else len(user_ids) ** -1.1
    settings = {
        "seed": config.seed,
        "rounds": config.rounds,
        "virtual_clients_per_round": config.virtual_clients_per_round,
        "schedule": schedule,
        "channels": config.channels,
        "image_size": config.image_size,
        "embedding_size": config.embedding_size,
        "num_identities": len(vocabulary),
        "groups": [int(layer.groups) for layer in gn],
        "group_norm_epsilon": float(gn[0].epsilon),
        "client_learning_rate": client.client_learning_rate,
        "client_momentum": client.momentum,
        "local_epochs": client.local_epochs,
        "batch_size": client.batch_size,
        "clip_norm": config.clip_norm,
        "noise_multiplier": config.noise_multiplier,
        "server_learning_rate": config.server_learning_rate,
        "server_momentum": config.server_momentum,
        "delta": delta,
        "users": len(user_ids),
        "sampling_probability": config.virtual_clients_per_round
        * config.users_per_virtual_client
        / len(user_ids),
    }
    np.savez(out_npz, settings=json.dumps(settings), **arrays)
    return settings


def _cpu_seconds() -> float:
    """CPU seconds of this process and the live processes under it (TFF's workers)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def _middle_rounds(wall: Sequence[float], cpu: Sequence[float]) -> dict:
    """Figures of rounds 2 .. R-1 from the seconds of rounds 2 .. R (module docstring)."""
    wall, cpu = list(wall)[:-1], list(cpu)[:-1]
    return {
        "round_wall_seconds": wall,
        "round_cpu_seconds": cpu,
        # None for a run too short to have such rounds (the same-work check's).
        "median_round_wall_seconds": statistics.median(wall) if wall else None,
        "median_round_cpu_seconds": statistics.median(cpu) if cpu else None,
    }


def _train(config: Any, data: tuple[str, str], work: str, executor: str) -> tuple[Any, dict]:
    """Our job, and its per-round figures (module docstring)."""
    from tff_algorithms.federated import runtime
    from tff_algorithms.jobs import train_job

    marks: list[tuple[float, float]] = []
    began = time.perf_counter()
    result = train_job.run_train_job(
        config,
        *data,
        work,
        progress=lambda record: marks.append((time.perf_counter(), _cpu_seconds())),
        runtime_config=runtime.RuntimeConfig(executor=executor),
    )
    return result, {
        "side": f"dp-fedemb dp-fedavg ({executor})",
        # A mark follows each round: their differences are rounds 2 .. R.
        **_middle_rounds(
            [b[0] - a[0] for a, b in zip(marks, marks[1:])],
            [b[1] - a[1] for a, b in zip(marks, marks[1:])],
        ),
        # The loop's own round_seconds (the step and the ledger, before the checkpoint
        # and the progress call), of the same rounds.
        "loop_round_seconds": [
            r["round_seconds"] for r in result.metrics["history"] if 2 <= r["round"] < config.rounds
        ],
        "job_wall_seconds": time.perf_counter() - began,
        "epsilon": result.metrics["epsilon"],
    }


def run_pfl(work_npz: str, work: str, threads: int, weights_npz: str | None = None) -> dict:
    out = os.path.join(work, f"pfl-{time.monotonic_ns()}.json")
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    command = [PFL_PYTHON, PFL_RUNNER, work_npz, out, "--threads", str(threads)]
    if weights_npz is not None:
        command += ["--weights", weights_npz]
    began = time.perf_counter()
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=PFL_TIMEOUT_SECONDS
    )
    if done.returncode:
        raise RuntimeError(f"pfl runner failed ({done.returncode}): {done.stderr[-2000:]}")
    with open(out) as f:
        result = json.load(f)
    return {
        "side": f"pfl FedAvg ({'PyTorch default threads' if not threads else f'{threads} thread'})",
        **_middle_rounds(result["round_wall_seconds"][1:], result["round_cpu_seconds"][1:]),
        "process_wall_seconds": time.perf_counter() - began,
        "threads": result["threads"],
        "versions": result["versions"],
        "pfl_epsilon": result["pfl_epsilon"],
    }


def same_work_check(work: str) -> dict:
    """Whether the two sides train the same rounds: at the check's sizes with no noise and
    one local step per client (a batch holds all of a client's examples, so their order,
    which differs between the sides, cannot matter), our trained backbone after
    `CHECK_SIZES` rounds and pfl's, both in PyTorch's layout, against how far training
    moved it."""
    from tff_algorithms.modeling import models

    sizes = CHECK_SIZES
    config = dataclasses.replace(
        job_config(sizes),
        noise_multiplier=0.0,
        batch_size=sizes["users_per_virtual_client"] * sizes["images"],
    )
    data = bench_training._write_data(
        os.path.join(work, "check_data"), sizes["identities"], sizes["images"], config.image_size
    )
    work_npz = os.path.join(work, "check.npz")
    export_work(config, data[0], work_npz)
    result, _ = _train(config, data, os.path.join(work, "check_ours"), "worker")
    ours = backbone_in_torch_layout(
        models.load_pretrained_backbone(config.backbone_config, result.saved_model_dir)
    )
    theirs_npz = os.path.join(work, "check_pfl.npz")
    run_pfl(work_npz, work, 1, theirs_npz)
    theirs, start = np.load(theirs_npz), np.load(work_npz)
    difference = max(float(np.abs(ours[k] - theirs[k]).max()) for k in ours)
    moved = max(float(np.abs(ours[k] - start[f"weight/{k}"]).max()) for k in ours)
    return {
        "sizes": sizes,
        "noise_multiplier": 0.0,
        "batch_size": config.batch_size,
        "max_abs_difference_ours_vs_pfl": difference,
        "max_abs_change_from_start": moved,
    }


def _ratio(ours: list[dict], theirs: list[dict], key: str) -> float:
    return statistics.median(a[key] / b[key] for a, b in zip(ours, theirs))


def run(
    out_json: str, quick: bool, in_process: bool, pfl_default_threads: bool, check: bool
) -> dict:
    if not os.path.exists(PFL_PYTHON):
        raise SystemExit(f"peer_pfl_round: {PFL_PYTHON} is missing; run `make peer-env` first")
    sizes = dict(QUICK_SIZES if quick else SIZES)
    config = job_config(sizes)
    work = tempfile.mkdtemp(prefix="peer_pfl_")
    load_start = [round(x, 2) for x in os.getloadavg()]
    sides = ["ours_worker", "pfl_1_thread"]
    if in_process:
        sides.append("ours_in_process")
    if pfl_default_threads:
        sides.append("pfl_default_threads")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    checked = None
    try:
        if check:
            checked = same_work_check(work)
            print(f"same work: {checked}", flush=True)
        data = bench_training._write_data(
            os.path.join(work, "data"), sizes["identities"], sizes["images"], config.image_size
        )
        work_npz = os.path.join(work, "work.npz")
        settings = export_work(config, data[0], work_npz)
        for repeat in range(sizes["repeats"]):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                out = os.path.join(work, f"{side}-{repeat}")
                if side.startswith("ours"):
                    executor = "worker" if side == "ours_worker" else "in_process"
                    _, figures = _train(config, data, out, executor)
                else:
                    figures = run_pfl(work_npz, work, 1 if side == "pfl_1_thread" else 0)
                runs[side].append(figures)
                print(
                    f"{side} #{repeat}: {figures['median_round_wall_seconds']:.3f} s wall, "
                    f"{figures['median_round_cpu_seconds']:.3f} s CPU per round",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = {}
    for ours in (s for s in sides if s.startswith("ours")):
        for theirs in (s for s in sides if s.startswith("pfl")):
            ratios[f"{ours}_over_{theirs}"] = {
                "wall": _ratio(runs[ours], runs[theirs], "median_round_wall_seconds"),
                "cpu": _ratio(runs[ours], runs[theirs], "median_round_cpu_seconds"),
            }
    report = {
        "quick": quick,
        "sizes": sizes,
        "work": {
            key: settings[key]
            for key in (
                "users",
                "virtual_clients_per_round",
                "rounds",
                "num_identities",
                "local_epochs",
                "batch_size",
                "client_learning_rate",
                "client_momentum",
                "clip_norm",
                "noise_multiplier",
                "server_learning_rate",
                "server_momentum",
                "delta",
                "sampling_probability",
            )
        }
        | {"users_per_virtual_client": config.users_per_virtual_client, "model": "small_cnn"},
        "timing": "per round, rounds 2 .. R-1 of each run, median; ratios: median over "
        "repeats of ours / pfl (below 1: ours faster)",
        "ratios": ratios,
        "same_work_check": checked,
        "accounting": {
            "ours": {
                "convention": OURS_ACCOUNTING,
                "epsilon": runs["ours_worker"][0]["epsilon"],
                "delta": settings["delta"],
            },
            "pfl": {
                "convention": PFL_ACCOUNTING,
                "epsilon_by_pfl_accountant": runs["pfl_1_thread"][0]["pfl_epsilon"],
                "delta": settings["delta"],
                "sampling_probability": settings["sampling_probability"],
            },
        },
        # run_all's record of the machine (its load average at the end), and at the start.
        "machine": {**run_all.machine(), "load_average_1_5_15_start": load_start},
        "runs": runs,
    }
    with open(out_json, "w") as f:
        json.dump(report, f, indent=2)
    return report


def _main(argv: list[str]) -> int:
    flags = {"--quick", "--in-process", "--pfl-default-threads", "--check"}
    options = set(argv[1:])
    if not argv or argv[0].startswith("-") or not options <= flags:
        print(
            "usage: python -m bench.peer_pfl_round OUT.json [--quick] [--in-process] "
            "[--pfl-default-threads] [--check]",
            file=sys.stderr,
        )
        return 2
    report = run(
        argv[0],
        "--quick" in options,
        "--in-process" in options,
        "--pfl-default-threads" in options,
        "--check" in options,
    )
    print(json.dumps(report["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
