"""Where a round's time goes (issue 40): the default recipe's round and the cached
embedding-only round against their arithmetic, against a plain TensorFlow program doing
the same round's math, and broken down by stage. `bench_speed` runs it in its measuring
child and writes its figures to `bench/results/speed_summary.json`.

Setting: the default recipe (`tff_algorithms/config/recipes.py`: 8 users per virtual
client, batch 8, 3 local epochs, class-mean heads, CosFace, conv and GroupNorm layers
trained) on 28x28 one-identity users of 4 images each (the default synthetic data's
shape), no noise (z = 0: the noise is one op per weight, and the plain program then
computes what TFF does). After the warm-up round the plain program's weights are compared
with TFF's (`plain_vs_tff_max_abs_difference`, 1e-5 to 3e-4: the same local steps of
the same code, summed in other orders).
Rows:

- `default`: the recipe's TFF round;
- `embedding_uncached` / `embedding_cached`: the recipe training the embedding layer
  alone, uncached and on cached features of the frozen trunk (`feature_cache`);
- `plain`: the default round as one plain TensorFlow program per core (no TFF, no
  per-client Python): each core's share of the round's virtual clients runs in one
  `tf.while_loop` over the same loader, client dataset and `LocalTrainer`, clipped and
  summed in the graph; then the mean and the server step. It runs in a child process
  with the TFF worker's thread setting (one thread per op, `_PlainRound`).

TFF rows alternate round by round after one warm-up round each (it traces), so load
changes hit every row alike; figures are medians. Arithmetic: the profiled FLOPs of the
round's local steps and of its class-mean first pass (one forward pass of every
example) at this run's measured peak (`bench_speed.measure_flops`: the best of a 1024² matmul, a
large-batch convolution and a large-batch training step).

The stage profile times, in plain TensorFlow on one core's worth of work, one virtual
client of the round: building its dataset and reading and decoding its records once
(`local_training.read_client`), the class-mean first pass, one local step on an
in-memory batch, and the whole client update. The op types
of one local step come from TensorFlow's step statistics (`RunMetadata`, FULL_TRACE).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

_FULL = {"users": 3_000, "clients_per_round": 48, "rounds": 3, "profile_clients": 12}
_QUICK = {"users": 64, "clients_per_round": 4, "rounds": 1, "profile_clients": 2}
IMAGES_PER_USER = 4
_ROWS = ("default", "embedding_uncached", "embedding_cached")
SUMMARY_FILE = "speed_summary.json"


def sizes(quick: bool) -> dict:
    return dict(_QUICK if quick else _FULL)


def configs(clients_per_round: int) -> dict:
    """The rows' TrainJobConfigs: the default recipe at z = 0 and its embedding-only
    variants, uncached and cached."""
    from tff_algorithms.config import job_config, recipes

    values = {k: v for k, v in recipes.DEFAULT.items() if k != "target_epsilon"}
    default = job_config.TrainJobConfig(
        **{**values, "virtual_clients_per_round": clients_per_round},
        noise_multiplier=0.0,
        evaluate_every=0,
    )
    embedding = dataclasses.replace(default, trainable_layers=("embedding",), cache_features=False)
    return {
        "default": default,
        "embedding_uncached": embedding,
        "embedding_cached": dataclasses.replace(embedding, cache_features=True),
    }


def _process(config, load_examples):  # noqa: ANN001, ANN202 - TrainJobConfig, loader
    from tff_algorithms.algorithms.dp_fedemb import aggregators, client_work, processes
    from tff_algorithms.federated import client_data, feature_cache

    client_config = config.client_config()
    return processes.build_fedemb_process(
        config.backbone_config,
        client_config,
        aggregators.gaussian_fixed(
            noise_multiplier=0.0,
            clip_norm=config.clip_norm,
            virtual_clients_per_round=config.virtual_clients_per_round,
            noise_seed=0,
        ),
        processes.server_sgdm(config.server_learning_rate, 0.0),
        backbone_seed=config.seed,
        feature_cut=feature_cache.cut_for(config.backbone_config).cut
        if config.cache_features
        else None,
        client_loader=client_work.ClientLoader(
            load_examples, client_data.expected_examples, client_data.seed_name
        ),
    )


def _loader(config, partition_dir: str, work_dir: str):  # noqa: ANN001, ANN202
    """(load_examples, partition the ids point into) of a row: images, or cached features
    of the frozen prefix (built here, outside the timed rounds)."""
    from tff_algorithms.federated import client_data, feature_cache
    from tff_algorithms.modeling import models

    if not config.cache_features:
        shape = config.image_shape
        return (lambda vc_id: client_data.load_examples(vc_id, shape)), partition_dir
    cut = feature_cache.cut_for(config.backbone_config).cut
    cached = feature_cache.ensure_cache(
        partition_dir,
        os.path.join(work_dir, "feature_cache"),
        config.backbone_config,
        models.build_backbone(config.backbone_config),
        cut,
    )
    return cached.load_examples, cached.partition_dir


def _plain_share_function(config):  # noqa: ANN001, ANN202 - a TrainJobConfig -> tf.function
    """One core's share of a plain round: its virtual clients in one `tf.while_loop`,
    each trained by `LocalTrainer` on the same loader and client dataset as TFF's and
    clipped, summed in the graph."""
    import tensorflow as tf

    from tff_algorithms.algorithms.dp_fedemb import client_work, local_training
    from tff_algorithms.federated import client_data
    from tff_algorithms.modeling import models

    client_config, shape = config.client_config(), config.image_shape
    trainer = local_training.LocalTrainer(
        lambda: models.build_backbone(config.backbone_config), client_config, None
    )
    train = tf.function(trainer.train)

    @tf.function(autograph=False)
    def clipped_sum(weights, vc_ids, round_num):  # noqa: ANN001, ANN202
        state = collections.OrderedDict(
            round_num=round_num, head_seed=tf.constant(client_config.head_seed, tf.int64)
        )

        def body(i, total):  # noqa: ANN001, ANN202
            vc_id = vc_ids[i]
            dataset = client_work.make_client_dataset(
                client_data.load_examples(vc_id, shape),
                client_data.seed_name(vc_id),
                client_config,
                client_data.expected_examples(vc_id),
            )
            result, _ = train(weights, dataset, state)
            clipped, _ = tf.clip_by_global_norm(result.update, config.clip_norm)
            return i + 1, [t + c for t, c in zip(total, clipped)]

        zeros = [tf.zeros_like(w) for w in weights.trainable]
        _, total = tf.while_loop(
            lambda i, _: i < tf.size(vc_ids), body, (0, zeros), parallel_iterations=1
        )
        return total

    return clipped_sum


def _plain_child(connection, config, cores: int, intra_op_threads: int) -> None:  # noqa: ANN001
    """The plain program's process: serves rounds until told to stop (None)."""
    import tensorflow as tf
    import tensorflow_federated as tff

    if intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    shares = [_plain_share_function(config) for _ in range(cores)]
    pool = concurrent.futures.ThreadPoolExecutor(cores)
    m, learning_rate = config.virtual_clients_per_round, config.server_learning_rate
    try:
        while (request := connection.recv()) is not None:
            trainable, non_trainable, ids, round_num = request
            weights = tff.learning.models.ModelWeights(
                trainable=[tf.constant(t) for t in trainable],
                non_trainable=[tf.constant(t) for t in non_trainable],
            )
            started = time.perf_counter()
            parts = [ids[c::cores] for c in range(cores)]
            round_tensor = tf.constant(round_num, tf.int64)
            sums = list(
                pool.map(
                    lambda share, part, w=weights, r=round_tensor: share(w, tf.constant(part), r),
                    shares,
                    parts,
                )
            )
            total = [tf.add_n(list(ts)) for ts in zip(*sums)]
            # Server SGD on the mean of the planned M (TFF's update convention: initial - final).
            new = [(w - learning_rate * t / m).numpy() for w, t in zip(weights.trainable, total)]
            connection.send((new, time.perf_counter() - started))
    finally:
        pool.shutdown()


class _PlainRound:
    """The default round as one plain TensorFlow program per core (module docstring).

    It runs in a child process whose TensorFlow runs each op on `intra_op_threads`
    threads (0: every core), the setting the TFF worker runs with
    (`runtime.RuntimeConfig.worker_intra_op_threads`): the two then run the same kernels,
    and the plain program measured faster with one thread per op than with every core
    per op (BENCHMARKS.md). The parent keeps every core for the peak it measures.
    """

    def __init__(self, config, cores: int, intra_op_threads: int) -> None:  # noqa: ANN001
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self._child = context.Process(
            target=_plain_child, args=(child_end, config, cores, intra_op_threads), daemon=True
        )
        self._child.start()
        child_end.close()

    def round(self, weights, ids: list[str], round_num: int):  # noqa: ANN001, ANN201
        """The next weights (a ModelWeights of arrays) and the round's seconds, timed in
        the child (its pipe transfers are not counted against the plain program)."""
        import numpy as np
        import tensorflow_federated as tff

        trainable = [np.asarray(t) for t in weights.trainable]
        non_trainable = [np.asarray(t) for t in weights.non_trainable]
        self._connection.send((trainable, non_trainable, list(ids), round_num))
        trainable, seconds = self._connection.recv()
        return tff.learning.models.ModelWeights(
            trainable=trainable, non_trainable=list(weights.non_trainable)
        ), seconds

    def close(self) -> None:
        try:
            self._connection.send(None)
            self._child.join(timeout=60)
        finally:
            if self._child.is_alive():
                self._child.kill()
                self._child.join()
            self._connection.close()


def forward_flops(config, cached: bool, batch: int) -> int:  # noqa: ANN001
    """Profiled FLOPs of one forward pass of `batch` examples (the first pass's work)."""
    import tensorflow as tf

    from bench import bench_transfer

    model = bench_transfer.trained_model(config, cached)
    spec = tf.TensorSpec([batch, *model.input_shape[1:]], tf.float32)
    graph = tf.function(lambda x: model(x, training=False)).get_concrete_function(spec).graph
    builder = tf.compat.v1.profiler.ProfileOptionBuilder
    options = builder(builder.float_operation()).with_empty_output().build()
    return int(tf.compat.v1.profiler.profile(graph, options=options).total_float_ops)


def _arithmetic(config, cached: bool, users_per_round: int, peak: float) -> dict:  # noqa: ANN001
    from bench import bench_transfer

    flops = bench_transfer.round_flops(config, cached, IMAGES_PER_USER, users_per_round)
    # The class-mean first pass: one forward pass of every example of the round.
    examples = users_per_round * IMAGES_PER_USER
    first_pass = forward_flops(config, cached, config.batch_size) * examples // config.batch_size
    total = flops["round_flops"] + first_pass
    return {
        **flops,
        "first_pass_flops": first_pass,
        "round_flops_with_first_pass": total,
        "arithmetic_seconds_at_peak": total / peak,
    }


def _step_op_types(config) -> dict[str, float]:  # noqa: ANN001
    """Milliseconds by op type of one default local step (batch 8), from TensorFlow's
    step statistics, mean of 5 traced runs after 10 warm-up steps."""
    import tensorflow as tf

    from tff_algorithms.modeling import identity_heads, models

    client_config, batch = config.client_config(), config.batch_size
    graph = tf.Graph()
    with graph.as_default():
        backbone = models.build_backbone(config.backbone_config)
        images = tf.random.stateless_uniform([batch, *config.image_shape], [1, 2])
        labels = tf.zeros([batch], tf.int32)
        head = tf.Variable(tf.zeros([config.embedding_size, client_config.head_capacity]))
        trained = [*backbone.trainable_weights, head]
        with tf.GradientTape() as tape:
            logits = identity_heads.head_logits(
                backbone(images, training=True), head, labels, client_config.head_loss, batch
            )
            loss = identity_heads.head_loss(logits, labels, tf.ones([batch], tf.bool))
        grads = tape.gradient(loss, trained)
        step = tf.group([v.assign_sub(0.01 * g) for v, g in zip(trained, grads)])
        init = tf.compat.v1.global_variables_initializer()
    totals: collections.Counter = collections.Counter()
    runs = 5
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        for _ in range(10):
            session.run(step)
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        for _ in range(runs):
            metadata = tf.compat.v1.RunMetadata()
            session.run(step, options=options, run_metadata=metadata)
            for device in metadata.step_stats.dev_stats:
                for node in device.node_stats:
                    label = node.timeline_label
                    op = label.split(" = ")[1].split("(")[0] if " = " in label else node.node_name
                    totals[op] += node.all_end_rel_micros / 1000 / runs
    return {op: round(ms, 3) for op, ms in totals.most_common()}


def _profile_client(config, ids: list[str]) -> dict:  # noqa: ANN001 - the default config
    """Milliseconds per virtual client of each stage (module docstring), mean over `ids`."""
    import tensorflow as tf
    import tensorflow_federated as tff

    from tff_algorithms.algorithms.dp_fedemb import client_work, local_training
    from tff_algorithms.federated import client_data
    from tff_algorithms.modeling import models

    client_config, shape = config.client_config(), config.image_shape

    def dataset(vc_id):  # noqa: ANN001, ANN202
        return client_work.make_client_dataset(
            client_data.load_examples(vc_id, shape),
            client_data.seed_name(vc_id),
            client_config,
            client_data.expected_examples(vc_id),
        )

    read_once_function = tf.function(
        lambda vc_id: local_training.read_client(dataset(vc_id)).identity
    )

    trainer = local_training.LocalTrainer(
        lambda: models.build_backbone(config.backbone_config), client_config, None
    )
    backbone = models.build_backbone(config.backbone_config)
    weights = tff.learning.models.ModelWeights(
        trainable=[tf.constant(v) for v in backbone.trainable_weights],
        non_trainable=[tf.constant(v) for v in backbone.non_trainable_weights],
    )
    train = tf.function(trainer.train)
    state = collections.OrderedDict(
        round_num=tf.constant(0, tf.int64), head_seed=tf.constant(client_config.head_seed, tf.int64)
    )
    first_pass = tf.function(
        lambda vc_id: trainer._first_pass(local_training.read_client(dataset(vc_id)))[1]
    )
    whole = tf.function(lambda vc_id: train(weights, dataset(vc_id), state)[0].update)

    def per_client_ms(function) -> float:  # noqa: ANN001
        """Best of 3 sweeps over `ids` of the mean milliseconds a client: the stages
        below are differences of these, so each gets its quietest moment."""
        function(tf.constant(ids[0]))  # traces
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for vc_id in ids:
                function(tf.constant(vc_id))
            best = min(best, 1000 * (time.perf_counter() - started) / len(ids))
        return best

    read_once = per_client_ms(read_once_function)
    first = per_client_ms(first_pass) - read_once
    client = per_client_ms(whole)
    steps_per_client = config.local_epochs * -(
        -config.users_per_virtual_client * IMAGES_PER_USER // config.batch_size
    )
    step_ms = _one_step_ms(config)
    return {
        "build_read_decode_once_ms": round(read_once, 2),
        "first_pass_forward_ms": round(first, 2),
        "local_step_ms": round(step_ms, 2),
        "local_steps_per_client": steps_per_client,
        "client_update_ms": round(client, 2),
        # What the parts above do not explain: the while loop's per-step dispatch and
        # batch gathers, the optimizer states, head set-up, update and checks.
        "client_rest_ms": round(client - read_once - first - steps_per_client * step_ms, 2),
        "clients_profiled": len(ids),
    }


def _one_step_ms(config) -> float:  # noqa: ANN001
    """Best mean milliseconds of one local step (batch 8, in-memory batch, `tf.function`)."""
    import tensorflow as tf

    from tff_algorithms.modeling import identity_heads, models

    client_config, batch = config.client_config(), config.batch_size
    backbone = models.build_backbone(config.backbone_config)
    images = tf.random.stateless_uniform([batch, *config.image_shape], [1, 2])
    labels = tf.zeros([batch], tf.int32)
    head = tf.Variable(tf.zeros([config.embedding_size, client_config.head_capacity]))
    trained = [*backbone.trainable_weights, head]

    @tf.function
    def step():  # noqa: ANN202
        with tf.GradientTape() as tape:
            logits = identity_heads.head_logits(
                backbone(images, training=True), head, labels, client_config.head_loss, batch
            )
            loss = identity_heads.head_loss(logits, labels, tf.ones([batch], tf.bool))
        for v, g in zip(trained, tape.gradient(loss, trained)):
            v.assign_sub(0.01 * g)
        return loss

    step()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(20):
            step()
        best = min(best, (time.perf_counter() - started) / 20)
    return 1000 * best


def measure(partition_dir: str, work_dir: str, size: dict, peak: float) -> dict:
    """Every row's rounds, the plain program's, the arithmetic and the stage profile."""
    from beam_jobs import partition
    from tff_algorithms.config import job_plan
    from tff_algorithms.federated import client_data, runtime

    rows = configs(size["clients_per_round"])
    user_ids = partition.PartitionReader(partition_dir).user_ids()
    plan = job_plan.schedule_for(rows["default"], len(user_ids))
    processes, ids = {}, {}
    for name, config in rows.items():
        load, source = _loader(config, partition_dir, work_dir)
        processes[name] = _process(config, load)
        ids[name] = client_data.VirtualClientIds(
            source, plan, partition.PartitionReader(source).user_ids()
        )
    cores = os.cpu_count() or 1
    workers = runtime.RuntimeConfig()
    plain = _PlainRound(rows["default"], cores, workers.worker_intra_op_threads)
    seconds: dict[str, list[float]] = {name: [] for name in (*_ROWS, "plain")}
    try:
        with runtime.session(workers):
            states = {name: process.initialize() for name, process in processes.items()}
            plain_weights = states["default"].global_model_weights
            # Round 0 warms up (traces); the plain program's first round is checked
            # against TFF's, which computes the same thing.
            difference = None
            for round_num in range(size["rounds"] + 1):
                for name, process in processes.items():
                    round_ids = ids[name].for_round(round_num)
                    started = time.perf_counter()
                    states[name] = process.next(states[name], round_ids).state
                    if round_num:
                        seconds[name].append(time.perf_counter() - started)
                plain_weights, plain_seconds = plain.round(
                    plain_weights, ids["default"].for_round(round_num), round_num
                )
                if round_num:
                    seconds["plain"].append(plain_seconds)
                else:
                    difference = max(
                        float(abs(a - b).max())
                        for a, b in zip(
                            states["default"].global_model_weights.trainable,
                            plain_weights.trainable,
                        )
                    )
    finally:
        plain.close()
    users_per_round = size["clients_per_round"] * rows["default"].users_per_virtual_client
    arithmetic = {
        "default": _arithmetic(rows["default"], False, users_per_round, peak),
        "embedding_uncached": _arithmetic(rows["embedding_uncached"], False, users_per_round, peak),
        "embedding_cached": _arithmetic(rows["embedding_cached"], True, users_per_round, peak),
    }
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    profile_ids = ids["default"].for_round(0)[: size["profile_clients"]]
    return {
        "round_seconds": {name: [round(s, 3) for s in values] for name, values in seconds.items()},
        "median_round_seconds": {name: round(s, 3) for name, s in medians.items()},
        "plain_vs_tff_max_abs_difference": difference,
        "arithmetic": arithmetic,
        "peak_flops_per_s": peak,
        "cores": cores,
        "profile": _profile_client(rows["default"], profile_ids),
        "step_op_ms": _step_op_types(rows["default"]),
    }


def summary(measured: dict) -> dict:
    """The four figures of `speed_summary.json` (issue 40 item 5), from one run."""
    medians, arithmetic = measured["median_round_seconds"], measured["arithmetic"]
    default = arithmetic["default"]
    at_peak = default["arithmetic_seconds_at_peak"]
    return {
        "default_round_over_arithmetic": round(medians["default"] / at_peak, 3),
        "cached_over_uncached_round": round(
            medians["embedding_uncached"] / medians["embedding_cached"], 3
        ),
        "step_overhead_ms": round(
            1000 * (medians["default"] - at_peak) / default["local_steps_per_round"], 3
        ),
        "tff_over_plain_round": round(medians["default"] / medians["plain"], 3),
        "median_round_seconds": medians,
        "default_arithmetic_seconds_at_peak": round(at_peak, 3),
        "peak_flops_per_s": measured["peak_flops_per_s"],
        "plain_vs_tff_max_abs_difference": measured["plain_vs_tff_max_abs_difference"],
    }


def write_summary(out_dir: str, measured: dict, size: dict, quick: bool) -> dict:
    """Writes `speed_summary.json` in `out_dir`; returns what it wrote."""
    from bench import run_all

    written = {"quick": quick, "machine": run_all.machine(), "sizes": size, **summary(measured)}
    with open(os.path.join(out_dir, SUMMARY_FILE), "w") as f:
        json.dump(written, f, indent=2, sort_keys=True)
        f.write("\n")
    return written


def main(argv: list[str] | None = None) -> int:
    """This section alone (`bench_speed` runs it with the rest): `python -m
    bench.round_speed [--quick] [--results-dir DIR]` writes speed_summary.json and
    round_speed.json there."""
    from bench import bench_speed, run_all

    parser = argparse.ArgumentParser(prog="python -m bench.round_speed")
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument("--results-dir", default=run_all.RESULTS_DIR)
    args = parser.parse_args(argv)
    size = sizes(args.quick)
    work = tempfile.mkdtemp(prefix="round_speed_")
    try:
        source = os.path.join(work, "partition")
        bench_speed.write_partition(
            source, size["users"], IMAGES_PER_USER, bench_speed.image_bank(400, IMAGES_PER_USER)
        )
        flops = bench_speed.measure_flops(
            {"flops_clients_per_round": 8, "users_per_virtual_client": 2, "flops_repeats": 10}
        )
        measured = measure(source, work, size, bench_speed.measured_peak(flops))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(args.results_dir, exist_ok=True)
    written = write_summary(args.results_dir, measured, size, args.quick)
    with open(os.path.join(args.results_dir, "round_speed.json"), "w") as f:
        json.dump({**measured, "summary": written}, f, indent=2, sort_keys=True)
        f.write("\n")
    print(json.dumps(written, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
