"""DP transfer learning: cached features for a frozen trunk and the DP baselines (issue 21,
item 3).

All rows train the private photo users of `bench_training` (the synthetic default, 20% of
identities held out) from the same backbone, pretrained without privacy on public
sketches (`bench_training.prepare`), through `train_job.run_train_job` at the same strict
target ε (`EPSILON` at δ `DELTA`): each job calibrates its own noise multiplier for its
schedule, and each row records the ε its metrics.json reports. Rows:

1. DP-FedEmb, the default recipe: convolutions and GroupNorm layers trained, the dense
   embedding frozen (not a suffix of the backbone, so never cached);
2. / 3. DP-FedEmb training the embedding layer alone, uncached (`cache_features` false)
   and cached (true: the frozen convolutional trunk runs once per image);
4. / 5. DP-FedEmb training the last conv block and the embedding (conv1, gn1,
   embedding), uncached and cached (the cache holds the first conv block's output);
6. dp-last-layer (zero embedding layer on cached features, user-level DP-SGD);
7. dp-sgd-centralized (user-level DP-SGD of the default recipe's trained layers).

The federated rows share `bench_training`'s schedule (8 users per virtual client, the
bench's virtual clients per round, fixed schedule and noise seeds) with fewer rounds
(`rounds`); the DP-SGD rows take their algorithm's recipe (`Algorithm.recipe`) with
the users per step scaled to this population and the steps given here.

Reported per row: recall@FAR 1e-3 / 1e-2 / 1e-1 on the held-out identities with 95%
bootstrap intervals (resampled identities shared by every row, so differences to row 1
are paired: `bench_contrastive`'s helpers), ε, the private job's wall time (metrics.json
`wall_seconds`, cache building included), the median step/round time (history, first
round left out: it traces), the cache's build time (metrics.json `feature_cache`), and
achieved FLOP/s against this machine's measured peak (`bench_speed.measure_flops`: the best of a
large matmul, a large-batch convolution and a large-batch training step). FLOPs of one
local step come from TensorFlow's profiler on the trained model's forward and backward
pass (the whole backbone uncached, the suffix after the cut cached) with the job's head,
times the local steps a round runs. Headline: the cached / uncached per-round speedup of
each suffix recipe, with where a round's time goes (arithmetic at peak vs the rest).

usage: python -m bench.run_all --only bench_transfer [--quick] [--results-dir DIR]
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import time
from collections.abc import Mapping

from bench import bench_contrastive, bench_speed, bench_training
from tff_algorithms import algorithms
from tff_algorithms.config import job_config, recipes
from tff_algorithms.config.job_config import DP_LAST_LAYER, DP_SGD_CENTRALIZED
from tff_algorithms.evaluation import scoring as evaluation
from tff_algorithms.federated import feature_cache
from tff_algorithms.jobs import job_outputs
from tff_algorithms.modeling import models

EPSILON = 8.0
DELTA = 1e-5
FARS = bench_contrastive.FARS

# bench_training's data and pretraining; fewer federated rounds so that seven jobs fit
# ~20 minutes of two shared cores. DP-SGD users per step: dp-sgd-centralized the users a
# federated round trains (12 x 8), dp-last-layer its recipe's share (1,024 of the default
# data's ~3,000 training users: a third) of these 800.
FULL = {
    **bench_training.FULL,
    "rounds": 10,
    "dp_sgd_steps": 40,
    "dp_sgd_users": 96,
    "last_layer_steps": 300,
    "last_layer_users": 266,
    "bootstrap": 500,
    "flops_repeats": 10,
}
QUICK = {
    **bench_training.QUICK,
    "identities": 60,
    "rounds": 3,
    "virtual_clients_per_round": 3,
    "pretrain_epochs": 1,
    "dp_sgd_steps": 3,
    "dp_sgd_users": 16,
    "last_layer_steps": 5,
    "last_layer_users": 21,
    "bootstrap": 50,
    "flops_repeats": 2,
}

DEFAULT = "dp-fedemb default (conv+gn)"
EMBEDDING = "dp-fedemb embedding"
LAST_BLOCK = "dp-fedemb conv1+gn1+embedding"
UNCACHED, CACHED = "uncached", "cached"
SUFFIX_RECIPES = {EMBEDDING: ["embedding"], LAST_BLOCK: ["conv1", "gn1", "embedding"]}


def suffix_recipes(sizes: Mapping) -> dict[str, list[str]]:
    """The suffix rows' layers for `sizes`' trunk: both on the small CNN; on a larger
    trunk (`bench_training.MOBILENET_V2_TRUNK`) the embedding alone, since its last
    block lies inside the one nested trunk layer, before which no cache can cut."""
    if "trunk" in sizes:
        return {EMBEDDING: SUFFIX_RECIPES[EMBEDDING]}
    return SUFFIX_RECIPES


def configs(sizes: Mapping) -> tuple[dict[str, job_config.TrainJobConfig], dict[str, str]]:
    """The rows' jobs by row name (module docstring), and the rows this checkout cannot
    configure (an algorithm `TrainJobConfig` does not accept yet) with why."""
    # bench_training's private recipe, seeds and schedule, at target ε instead of a z.
    base = dataclasses.replace(
        bench_training.base_config(sizes),
        noise_multiplier=None,
        target_epsilon=EPSILON,
        delta=DELTA,
    )
    unavailable: dict[str, str] = {}
    rows = {DEFAULT: base}
    for name, layers in suffix_recipes(sizes).items():
        for label, cache in ((UNCACHED, False), (CACHED, True)):
            rows[f"{name} {label}"] = dataclasses.replace(
                base, trainable_layers=layers, cache_features=cache
            )
    for algorithm, steps, users in (
        (DP_LAST_LAYER, sizes["last_layer_steps"], sizes["last_layer_users"]),
        (DP_SGD_CENTRALIZED, sizes["dp_sgd_steps"], sizes["dp_sgd_users"]),
    ):
        try:
            spec = algorithms.get(algorithm)
            values = {
                **spec.recipe,
                "over_selection": 0.0,
                "rounds": steps,
                spec.section.name: {"users_per_step": users},
                "evaluate_every": 0,
            }
            # The base's flat counts give way to the algorithm's section (from_dict).
            rows[algorithm] = job_config.TrainJobConfig.from_dict(
                recipes.overlay(base.to_dict(), values)
            )
        except ValueError as error:
            unavailable[algorithm] = str(error)
    return rows, unavailable


def trained_model(config: job_config.TrainJobConfig, cached: bool):  # noqa: ANN202
    """The model a local step differentiates: the backbone, or the suffix after the cut."""
    backbone = models.build_backbone(config.backbone_config)
    if not cached:
        return backbone
    cut = feature_cache.cut_for(config.backbone_config).cut
    return cut.split(backbone)[1]


def step_flops(
    config: job_config.TrainJobConfig, cached: bool, batch: int, head_rows: int
) -> dict[str, int]:
    """FLOPs of one local step (forward, head loss, gradients of the trained variables and
    the head) from TensorFlow's profiler, as `bench_speed.measure_flops` counts them: of the
    whole traced graph, and of the ops its outputs need (what runs)."""
    import tensorflow as tf
    from tensorflow.python.framework import ops

    from tff_algorithms.modeling import identity_heads

    model = trained_model(config, cached)
    head = tf.Variable(tf.zeros([config.embedding_size, head_rows]))
    trained = [*model.trainable_weights, head]
    loss_config = config.head_loss_config

    def loss_and_grads(inputs, labels):  # noqa: ANN001, ANN202
        # Frozen layers' variables are trainable tf.Variables: watched, they would add
        # their gradients' ops to the graph that the profiler counts.
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(trained)
            logits = identity_heads.head_logits(
                model(inputs, training=True), head, labels, loss_config
            )
            loss = identity_heads.head_loss(logits, labels, tf.ones_like(labels, tf.bool))
        return loss, tape.gradient(loss, trained)

    input_spec = tf.TensorSpec([batch, *model.input_shape[1:]], tf.float32)
    traced = tf.function(loss_and_grads).get_concrete_function(
        input_spec, tf.TensorSpec([batch], tf.int32)
    )
    graph = traced.graph
    builder = tf.compat.v1.profiler.ProfileOptionBuilder
    options = builder(builder.float_operation()).with_empty_output().build()
    whole = int(tf.compat.v1.profiler.profile(graph, options=options).total_float_ops)
    # Only the ops the step's outputs need, each counted by the statistic the profiler
    # sums: a convolution's gradient function also builds the input gradient, which a
    # frozen prefix or a cached input never uses (TensorFlow prunes it when it runs the
    # function; the profiler of the whole graph counts it).
    needed, stack = set(), [t.op for t in traced.outputs]
    while stack:
        op = stack.pop()
        if op.name not in needed:
            needed.add(op.name)
            stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    pruned = 0
    for op in graph.get_operations():
        if op.name in needed:
            try:
                pruned += ops.get_stats_for_node_def(graph, op.node_def, "flops").value or 0
            except ValueError:  # an op the profiler has no count for either
                pass
    return {"whole_graph": whole, "needed": int(pruned)}


def round_flops(config: job_config.TrainJobConfig, cached: bool, images: int, users: int) -> dict:
    """FLOPs of one round (federated) or step (DP-SGD): the local steps it runs x the
    profiled FLOPs of one. Every user holds `images` images; `users` training users."""
    if config.algorithm in (DP_LAST_LAYER, DP_SGD_CENTRALIZED):
        # One gradient per sampled user over its images, the global head's rows.
        batch, steps = images, config.virtual_clients_per_round
        counted = step_flops(config, cached, batch, users)
    else:
        batch = config.batch_size
        per_client = config.local_epochs * math.ceil(
            config.users_per_virtual_client * images / batch
        )
        steps = per_client * config.virtual_clients_per_round
        counted = step_flops(config, cached, batch, config.client_config().head_capacity)
    return {
        "local_step_batch": batch,
        "local_step_flops": counted["needed"],
        "local_step_flops_whole_graph": counted["whole_graph"],
        "local_steps_per_round": steps,
        "round_flops": counted["needed"] * steps,
    }


def _describe(result: job_outputs.TrainJobResult) -> dict:
    metrics = result.metrics
    # Round 0 of a federated history is the start's evaluation, not a round.
    seconds = [r["round_seconds"] for r in metrics["history"] if r["round"] >= 1]
    cache = metrics.get("feature_cache") or {}
    return {
        **bench_training.held_out_recall(result),
        "epsilon": metrics["epsilon"],
        "delta": metrics["delta"],
        "noise_multiplier": metrics["noise_multiplier_source"]["noise_multiplier"],
        "rounds": metrics["rounds"],
        "rounds_are": metrics["rounds_are"],
        "trained_parameters": metrics["trained_parameters"],
        "wall_seconds": metrics["wall_seconds"],
        "first_round_seconds": seconds[0],
        "median_round_seconds": statistics.median(seconds[1:] or seconds),
        "rounds_seconds_total": sum(seconds),
        # Building the process or step function, the cache, evaluation and export.
        "outside_rounds_seconds": metrics["wall_seconds"] - sum(seconds),
        "feature_cache": {
            key: cache[key]
            for key in ("used", "reason", "cut_before", "ready_seconds")
            if key in cache
        },
        "saved_model": result.saved_model_dir,
    }


def _speed(row: dict, flops: dict, peak: float) -> dict:
    achieved = flops["round_flops"] / row["median_round_seconds"]
    at_peak = flops["round_flops"] / peak
    return {
        **flops,
        "achieved_flops_per_s": achieved,
        "achieved_over_peak": achieved / peak,
        # Where a round's time goes: its arithmetic at this machine's peak, and the rest
        # (TFF dispatch, data loading, clipping and aggregation, small-op inefficiency).
        "arithmetic_seconds_at_peak": at_peak,
        "other_seconds": row["median_round_seconds"] - at_peak,
    }


def run(out_dir: str, quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    load_start = [round(x, 2) for x in os.getloadavg()]
    work = os.path.join(out_dir, "bench_transfer_work")
    shutil.rmtree(work, ignore_errors=True)
    began = time.perf_counter()
    data, _, pretrained = bench_training.prepare(work, sizes)
    prepare_seconds = time.perf_counter() - began
    jobs, unavailable = configs(sizes)
    results: dict[str, job_outputs.TrainJobResult] = {}

    def keep(config: job_config.TrainJobConfig, result: job_outputs.TrainJobResult) -> dict:
        results[next(n for n, c in jobs.items() if c is config)] = result
        return _describe(result)

    rows = bench_training.train_each(
        "bench_transfer", jobs, data, work, keep, pretrained.saved_model_dir
    )
    rows.update({name: {"failed": why} for name, why in unavailable.items()})
    users = results[DEFAULT].metrics["training_users"]
    # Recall intervals: every row's embeddings on the same identity resamples.
    embeddings, labels = {}, None
    for name, result in {"public-pretrained start": pretrained, **results}.items():
        labels, embeddings[name] = evaluation.embed_saved_model(result.saved_model_dir, data[1])
    table, samples = bench_contrastive._recall_table(embeddings, labels, sizes["bootstrap"])
    peak_figures = bench_speed.measure_flops(
        {
            "flops_clients_per_round": 1,
            "users_per_virtual_client": 1,
            "flops_repeats": sizes["flops_repeats"],
        }
    )
    peak = max(
        peak_figures["peak_matmul_flops_per_s"],
        peak_figures["peak_conv_flops_per_s"],
        peak_figures["large_batch_step_flops_per_s"],
    )
    start_recall = table["public-pretrained start"]["0.01"]["recall"]
    for name, row in rows.items():
        if "failed" in row:
            continue
        cached = bool(row["feature_cache"].get("used")) or name == DP_LAST_LAYER
        row["speed"] = _speed(row, round_flops(jobs[name], cached, sizes["images"], users), peak)
        row["recall_intervals"] = table[name]
        if name != DEFAULT:
            row["paired_minus_default"] = bench_contrastive._paired(samples, name, DEFAULT)
        row["recall_1e-2_per_second"] = row["recall_at_far_1e-2"] / row["wall_seconds"]
        row["recall_1e-2_gain_over_start_per_second"] = (
            row["recall_at_far_1e-2"] - start_recall
        ) / row["wall_seconds"]
    speedups = {}
    for name in suffix_recipes(sizes):
        slow, fast = rows[f"{name} {UNCACHED}"], rows[f"{name} {CACHED}"]
        if "failed" in slow or "failed" in fast:
            continue
        speedups[name] = {
            "round_seconds_uncached": slow["median_round_seconds"],
            "round_seconds_cached": fast["median_round_seconds"],
            "per_round_speedup": slow["median_round_seconds"] / fast["median_round_seconds"],
            "wall_speedup": slow["wall_seconds"] / fast["wall_seconds"],
            "round_flops_ratio": slow["speed"]["round_flops"] / fast["speed"]["round_flops"],
            "cache_ready_seconds": fast["feature_cache"].get("ready_seconds"),
            "goal_5x_met": slow["median_round_seconds"] / fast["median_round_seconds"] >= 5.0,
        }
    finished = [n for n, r in rows.items() if "failed" not in r]
    return {
        "quick": quick,
        "load_average_start_1_5_15": load_start,
        "target_epsilon": EPSILON,
        "delta": DELTA,
        "sizes": dict(sizes),
        "training_users": users,
        "prepare_seconds": prepare_seconds,
        "pretrained": {"recall": table["public-pretrained start"]},
        "peak": {**peak_figures, "peak_flops_per_s": peak},
        "rows": {
            name: {k: v for k, v in row.items() if k != "saved_model"} for name, row in rows.items()
        },
        "cached_speedup": speedups,
        "best_recall_1e-2_per_second": max(
            finished, key=lambda n: rows[n]["recall_1e-2_per_second"], default=None
        ),
        "best_recall_1e-2": max(
            finished, key=lambda n: rows[n]["recall_at_far_1e-2"], default=None
        ),
        "configs": {
            name: {
                "algorithm": c.algorithm,
                "trainable_layers": list(c.trainable_layers),
                "cache_features": c.cache_features,
                "rounds": c.rounds,
                "virtual_clients_per_round": c.virtual_clients_per_round,
                "users_per_virtual_client": c.users_per_virtual_client,
                "head_loss": c.head_loss,
                "server_learning_rate": c.server_learning_rate,
                "server_momentum": c.server_momentum,
            }
            for name, c in jobs.items()
        },
    }
