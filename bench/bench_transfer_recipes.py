"""The seed paper's DP last layer against the product's recipes at equal strict ε (issue 42,
item 4).

`bench/bench_transfer.py`'s setting: `bench_training`'s private photo users, the backbone
pretrained without privacy on public sketches, each job at a strict target ε (δ `DELTA`)
calibrating its own noise multiplier for its schedule. At each target ε the arms are:

(a) the seed paper's recipe: dp-last-layer with `dp_sgd.full_batch` (every training user
    in every step, no sampling), DP-Adam, the zero-initialised embedding layer on cached
    features, for `recipe_steps` steps (1, 3 and 10 at the full size) and with the
    paper's sigmoid head for `sigmoid_steps` (1). The learning rate is chosen from `learning_rates` by recall@FAR
    1e-2 on a VALIDATION split: identities outside both the training users and the test
    identities. Every run of the sweep sees the training users, so the released model's
    ε is that of the whole sweep (its runs composed). Two forms: "sweep at target", every
    run at the z that makes the whole sweep meet the target (the equal-ε comparison, and
    the headline), and, for `per_run_target_steps`, "one run at target", every run
    calibrated to the target alone, its row stating the larger ε of its sweep. The
    validation identities are held out like the test ones; the selection does not
    protect them. At 1 step from the zero layer, Adam's update is lr·ĝ/(|ĝ| + ε), so the
    learning rate only scales the embedding, which serving L2-normalises: every run of a
    1-step sweep scores the same, and the selection could be skipped at no cost.
(b) dp-last-layer as the product runs it today: its recipe (sampled users, SGD with
    momentum 0.9), `bench_transfer`'s users per step and steps;
(c) DP-FedEmb on the same layer (embedding only, cached features);
(d) DP-FedEmb with the default recipe (convolutions and GroupNorm layers).

On a larger trunk (`--trunk mobilenet_v2`: `bench_training.MOBILENET_V2_TRUNK`, the
config's MobileNetV2 with GroupNorm on 32x32 grey images of the same generator,
pretrained the same way but on public photos of other identities, since from the
sketches its start stays at chance on the photos) the frozen prefix is most of the model:
2.2M of its 2.4M parameters lie in the one nested trunk layer, before the embedding.
(a), (b) and (c) train the embedding layer on cached features of the whole trunk (the
cache cuts only before a top-level layer). (d) is the default recipe (DP-FedEmb,
CosFace, class-mean heads, its schedule) with the layers it trains moved to this trunk:
the trunk's last convolution (Conv_1, 320 to 1,280 channels), its GroupNorm and the
embedding, 0.58M parameters, uncached (the cut would fall inside the nested trunk).
The small CNN's default trains every convolution and GroupNorm (its embedding frozen);
here that would be 2.2M noised coordinates and a backward pass through the whole trunk
at every local step, so (d) trains the trunk's top and the embedding after it. The last
inverted residual block as well would nearly double the noised coordinates (1.05M) and
add its backward pass. Its sizes (FULL_MOBILENET_V2) keep fewer (a) rows, said there.

Reported per target: recall@FAR 1e-3 / 1e-2 / 1e-1 on the held-out test identities with
95% bootstrap intervals, the paired differences of (a) at 1 step against every other arm
(`scoring.compare_saved_models`: both scored on each identity resample), each job's ε
and z, and wall time (metrics.json `wall_seconds`, cache building included; for (a) also
the sweep's total).

usage: python -m bench.run_all --only bench_transfer_recipes [--quick] [--results-dir DIR]
       python -m bench.bench_transfer_recipes --trunk mobilenet_v2 [--quick] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping

import tensorflow as tf

from beam_jobs import partition, schema, synthetic
from bench import bench_training, bench_transfer, run_all
from tff_algorithms.config import job_config, job_plan, model_config, recipes
from tff_algorithms.config.job_config import DP_LAST_LAYER
from tff_algorithms.evaluation import scoring
from tff_algorithms.jobs import job_outputs
from tff_algorithms.privacy import accounting

DELTA = bench_transfer.DELTA
# The quick population (48 training users, 24 a DP-FedEmb round for 3 rounds) cannot
# reach ε 2 (DP-FedEmb needs z 4.3, above the calibration's bound).
TARGET_EPSILONS = {"full": (2.0, 4.0, 8.0), "quick": (4.0, 8.0)}
# Selection metric on the validation split: 1e-3 rests on too few impostor pairs there.
SELECT_AT_FAR = "0.01"

FULL = {
    **bench_transfer.FULL,
    "validation_identities": 100,
    "recipe_steps": (1, 3, 10),
    "sigmoid_steps": (1,),
    "per_run_target_steps": (1,),
    # The paper sweeps DP-Adam's lr over 1e-4..1e-3 for its head; this layer has far more
    # outputs per input, so the grid is wider and coarser.
    "learning_rates": (1e-3, 1e-2, 1e-1),
    "bootstrap": 1000,
}
# The quick size runs every kind of (a) row once, on a 2-value grid.
QUICK = {
    **bench_transfer.QUICK,
    "validation_identities": 12,
    "recipe_steps": (1, 3),
    "sigmoid_steps": (1,),
    "per_run_target_steps": (1,),
    "learning_rates": (1e-2, 1e-1),
    "bootstrap": 100,
}

# The same arms on MobileNetV2 (`bench_training.MOBILENET_V2_TRUNK`; `main` runs them,
# `run_all` does not). Its jobs take 2-5 minutes each on two cores, (d) uncached about
# 11 (building the trunk and the computations around it), so (a) keeps two rows, each one run
# at target: 1 step (every learning rate scores the same there, so there is nothing to
# sweep or charge) and 10 steps at lr 0.1, the rate every 3- and 10-step sweep of the
# small CNN chose (that choice saw these users through another model, uncharged); no
# 3-step or sigmoid rows (within ±0.01 of 1 step there). Pretrained on the public
# sketches this trunk's start scores at chance on the photos, so it pretrains on public
# photos of other identities (`MOBILENET_V2_TRUNK`), for 24 epochs: 6 reached recall@FAR
# 1e-1 0.22, 24 0.33 (BENCHMARKS.md, "The same arms on MobileNetV2").
FULL_MOBILENET_V2 = {
    **FULL,
    "pretrain_epochs": 24,
    "trunk": bench_training.MOBILENET_V2_TRUNK,
    "recipe_steps": (1, 10),
    "sigmoid_steps": (),
    "per_run_target_steps": (),
    "learning_rates": {1: (1e-1,), 10: (1e-1,)},
}
QUICK_MOBILENET_V2 = {
    **QUICK,
    "trunk": bench_training.MOBILENET_V2_TRUNK,
    "recipe_steps": (1, 3),
    "sigmoid_steps": (),
    "per_run_target_steps": (),
    "learning_rates": {1: (1e-1,), 3: (1e-1,)},
}
SIZES = {
    model_config.SMALL_CNN: {"full": FULL, "quick": QUICK},
    model_config.MOBILENET_V2: {"full": FULL_MOBILENET_V2, "quick": QUICK_MOBILENET_V2},
}

SEED = "(a) dp-last-layer full batch, DP-Adam"
SAMPLED = "(b) dp-last-layer today (sampled, SGD+momentum)"
EMBEDDING = "(c) dp-fedemb embedding (cached)"
DEFAULT = "(d) dp-fedemb default (conv+gn)"


def default_name(sizes: Mapping) -> str:
    """Arm (d)'s name: on a larger trunk, the default recipe with the trunk's layers."""
    if "trunk" not in sizes:
        return DEFAULT
    layers = "+".join(sizes["trunk"]["trainable_layers"])
    return f"(d) dp-fedemb default recipe ({layers}, uncached)"


SWEEP_AT_TARGET = "sweep at target"
RUN_AT_TARGET = "one run at target"


def seed_name(steps: int, sigmoid: bool, charged: str = SWEEP_AT_TARGET) -> str:
    """The (a) arm's name for a step count, head and way of meeting the target."""
    head = ", sigmoid head" if sigmoid else ""
    return f"{SEED}, {steps} step{'s' if steps > 1 else ''}{head}, {charged}"


def seed_config(
    last_layer: job_config.TrainJobConfig, steps: int, learning_rate: float, sigmoid: bool
) -> job_config.TrainJobConfig:
    """The seed paper's last layer (arm (a)) from today's dp-last-layer job: every user
    each step, DP-Adam (momentum is Adam's own), `steps` steps at `learning_rate`."""
    values = {
        "rounds": steps,
        "server_learning_rate": learning_rate,
        "server_momentum": 0.0,
        "dp_sgd": {
            "users_per_step": "auto",
            "full_batch": True,
            "optimizer": "adam",
            "sigmoid_head": sigmoid,
        },
    }
    return job_config.TrainJobConfig.from_dict(recipes.overlay(last_layer.to_dict(), values))


def sweep_noise_multiplier(
    config: job_config.TrainJobConfig, runs: int, target: float, num_users: int
) -> float:
    """The z at which `runs` full-batch jobs of `config`'s steps meet `target` together:
    one job of runs × steps steps (full-batch steps compose as Gaussian mechanisms)."""
    whole = dataclasses.replace(config, rounds=runs * config.rounds, target_epsilon=target)
    return whole.calibrated_for(num_users)[0].noise_multiplier


def learning_rates(sizes: Mapping, steps: int) -> tuple[float, ...]:
    """The (a) arm's learning-rate grid at `steps` steps: `learning_rates`, or its entry
    for `steps` where the sizes give a grid per step count."""
    grid = sizes["learning_rates"]
    return tuple(grid[steps]) if isinstance(grid, Mapping) else tuple(grid)


def configs(
    sizes: Mapping, targets: tuple[float, ...], num_users: int
) -> tuple[dict[str, job_config.TrainJobConfig], dict[tuple[float, str], list[tuple[float, str]]]]:
    """Every job by name, and the (a) sweeps: (target, arm) -> [(learning rate, job name)]."""
    rows, unavailable = bench_transfer.configs(sizes)
    if unavailable:
        raise ValueError(f"bench_transfer_recipes: this checkout cannot configure {unavailable}")
    others = {
        SAMPLED: rows[DP_LAST_LAYER],
        EMBEDDING: rows[f"{bench_transfer.EMBEDDING} {bench_transfer.CACHED}"],
        default_name(sizes): rows[bench_transfer.DEFAULT],
    }
    variants = [(steps, False) for steps in sizes["recipe_steps"]]
    variants += [(steps, True) for steps in sizes["sigmoid_steps"]]
    jobs: dict[str, job_config.TrainJobConfig] = {}
    sweeps: dict[tuple[float, str], list[tuple[float, str]]] = {}
    for target in targets:
        for steps, sigmoid in variants:
            rates = learning_rates(sizes, steps)
            base = seed_config(rows[DP_LAST_LAYER], steps, rates[0], sigmoid)
            whole_sweep = sweep_noise_multiplier(base, len(rates), target, num_users)
            privacy = {SWEEP_AT_TARGET: {"noise_multiplier": whole_sweep, "target_epsilon": None}}
            if steps in sizes["per_run_target_steps"] and not sigmoid:
                privacy[RUN_AT_TARGET] = {"target_epsilon": target}
            for charged, fields in privacy.items():
                arm = seed_name(steps, sigmoid, charged)
                sweeps[target, arm] = []
                for rate in rates:
                    name = f"eps={target:g} {arm}, lr={rate:g}"
                    jobs[name] = dataclasses.replace(
                        seed_config(rows[DP_LAST_LAYER], steps, rate, sigmoid), **fields
                    )
                    sweeps[target, arm].append((rate, name))
        for arm, config in others.items():
            jobs[f"eps={target:g} {arm}"] = dataclasses.replace(config, target_epsilon=target)
    return jobs, sweeps


def write_validation(work: str, sizes: Mapping) -> str:
    """Validation records under WORK: `validation_identities` more synthetic photo
    identities after the test ones (the same generator and seed as `bench_training`'s,
    whose identities do not depend on how many there are)."""
    first = sizes["identities"]
    config = synthetic.SyntheticConfig(
        identities=first + sizes["validation_identities"],
        images_per_identity=sizes["images"],
        image_size=bench_training.image_size(sizes),
        seed=0,
    )
    records_dir = os.path.join(work, "validation")
    tf.io.gfile.makedirs(records_dir)
    path = os.path.join(records_dir, "records-00000-of-00001.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for record in synthetic.records_for_identities(config, first, config.identities):
            writer.write(schema.serialize(record))
    return records_dir


def _describe(config: job_config.TrainJobConfig, result: job_outputs.TrainJobResult) -> dict:
    metrics = result.metrics
    cache = metrics.get("feature_cache") or {}
    return {
        "saved_model": result.saved_model_dir,
        "epsilon": metrics["epsilon"],
        "delta": metrics["delta"],
        "noise_multiplier": metrics["noise_multiplier_source"]["noise_multiplier"],
        "rounds": metrics["rounds"],
        "wall_seconds": metrics["wall_seconds"],
        # Part of wall_seconds: the frozen prefix run once over the training images.
        "cache_ready_seconds": cache.get("ready_seconds"),
    }


def sweep_epsilon(
    config: job_config.TrainJobConfig, noise_multiplier: float, runs: int, num_users: int
) -> float:
    """The strict ε of `runs` full-batch jobs of `config`'s steps at `noise_multiplier`
    (every run calibrates the same z for the same target and steps): one job of
    runs × steps steps, since full-batch steps compose as Gaussian mechanisms."""
    whole = dataclasses.replace(
        config,
        target_epsilon=None,
        noise_multiplier=noise_multiplier,
        rounds=runs * config.rounds,
    )
    spec = job_plan.accounting_spec_for(whole, num_users)
    return accounting.compute_privacy(spec).epsilon


def select(
    jobs: Mapping[str, job_config.TrainJobConfig],
    sweep: list[tuple[float, str]],
    trained: Mapping[str, dict],
    validation_dir: str,
    num_users: int,
) -> dict:
    """The sweep's run with the best validation recall@FAR 1e-2 (the smaller learning
    rate on a tie), what each run scored, and the ε and wall time of the whole sweep."""
    scored = {}
    for rate, name in sweep:
        if "saved_model" in trained[name]:
            result = scoring.evaluate_saved_model(trained[name]["saved_model"], validation_dir)
            scored[rate] = result["recall_at_far"][SELECT_AT_FAR]
    if not scored:
        return {"failed": {name: trained[name] for _, name in sweep}}
    chosen = max(scored, key=lambda rate: (scored[rate], -rate))
    name = dict(sweep)[chosen]
    finished = [n for _, n in sweep if "saved_model" in trained[n]]
    return {
        "job": name,
        "learning_rate": chosen,
        f"validation_recall_at_far_{SELECT_AT_FAR}": scored,
        "sweep_runs": len(sweep),
        "sweep_epsilon": sweep_epsilon(
            jobs[name], trained[name]["noise_multiplier"], len(sweep), num_users
        ),
        "sweep_wall_seconds": sum(trained[n]["wall_seconds"] for n in finished),
        "selection": "every run of the sweep saw the training users: the released "
        "model's ε is sweep_epsilon, not the one run's epsilon",
    }


def results_suffix(trunk: str) -> str:
    """What a trunk's file names add: nothing for the small CNN (`run_all`'s names)."""
    return "" if trunk == model_config.SMALL_CNN else f"_{trunk}"


def run(out_dir: str, quick: bool, trunk: str = model_config.SMALL_CNN) -> dict:
    size = "quick" if quick else "full"
    sizes = SIZES[trunk][size]
    targets = TARGET_EPSILONS[size]
    load_start = [round(x, 2) for x in os.getloadavg()]
    work = os.path.join(out_dir, f"bench_transfer_recipes{results_suffix(trunk)}_work")
    shutil.rmtree(work, ignore_errors=True)
    began = time.perf_counter()
    data, _, pretrained = bench_training.prepare(work, sizes)
    prepare_seconds = time.perf_counter() - began
    validation_dir = write_validation(work, sizes)
    num_users = partition.read_manifest(data[0])["users"]
    jobs, sweeps = configs(sizes, targets, num_users)
    trained = bench_training.train_each(
        "bench_transfer_recipes", jobs, data, work, _describe, pretrained.saved_model_dir
    )
    by_target = {}
    for target in targets:
        arms: dict[str, dict] = {}
        for (sweep_target, arm), sweep in sweeps.items():
            if sweep_target == target:
                arms[arm] = select(jobs, sweep, trained, validation_dir, num_users)
        for arm in (SAMPLED, EMBEDDING, default_name(sizes)):
            arms[arm] = {"job": f"eps={target:g} {arm}"}
        # The paper's headline row first: compare_saved_models pairs it with every other.
        headline = seed_name(1, False)
        usable = {
            arm: trained[arms[arm]["job"]]["saved_model"]
            for arm in sorted(arms, key=lambda arm: arm != headline)
            if "job" in arms[arm] and "saved_model" in trained[arms[arm]["job"]]
        }
        compared = (
            scoring.compare_saved_models(usable, data[1], sizes["bootstrap"])
            if headline in usable and len(usable) > 1
            else {}
        )
        for arm, row in arms.items():
            if "job" not in row:
                continue
            job = trained[row["job"]]
            row.update({k: v for k, v in job.items() if k != "saved_model"})
            if arm in compared:
                row["recall_at_far"] = compared[arm]["recall_at_far"]
                row["recall_at_far_interval"] = compared[arm]["recall_at_far_interval"]
        by_target[f"{target:g}"] = {
            "arms": arms,
            "headline": headline,
            "headline_minus_arm_paired": compared.get(headline, {}).get("versus", {}),
        }
    shutil.rmtree(work, ignore_errors=True)
    return {
        "quick": quick,
        "trunk": trunk,
        "load_average_start_1_5_15": load_start,
        # Writing the data and pretraining on the public sketches, not part of any arm.
        "prepare_seconds": prepare_seconds,
        "pretrain_wall_seconds": pretrained.metrics["wall_seconds"],
        "target_epsilons": list(targets),
        "delta": DELTA,
        "sizes": dict(sizes),
        "training_users": num_users,
        "validation_identities": sizes["validation_identities"],
        "selection_metric": f"validation recall@FAR {SELECT_AT_FAR}",
        "bootstrap_resamples": sizes["bootstrap"],
        "pretrained_recall_at_far": pretrained.recall_at_far,
        "by_target_epsilon": by_target,
    }


def main(argv: list[str] | None = None) -> int:
    """One trunk's run, its JSON in `run_all`'s form: the small CNN's in
    bench_transfer_recipes.json (as `run_all` writes it), another's in
    bench_transfer_recipes_<trunk>.json."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--trunk", choices=sorted(SIZES), default=model_config.SMALL_CNN)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--results-dir", default=run_all.RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args(argv)
    os.makedirs(args.results_dir, exist_ok=True)
    machine = run_all.machine()
    start = time.perf_counter()
    result = run(args.results_dir, args.quick, args.trunk)
    name = f"bench_transfer_recipes{results_suffix(args.trunk)}.json"
    with open(os.path.join(args.results_dir, name), "w") as f:
        json.dump(
            {
                "machine": machine,
                "wall_seconds": time.perf_counter() - start,
                "load_average_end_1_5_15": [round(x, 2) for x in os.getloadavg()],
                **result,
            },
            f,
            indent=2,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
