"""Speed and scale of federated training (issue 7): every figure is a ratio to a baseline
measured in the same run, because the benchmark machines are shared and noisy.

Sections (all DP-FedEmb, small CNN on 28x28 faces-like users: one identity each):
- `federation_overhead`: TFF round time vs a tuned plain TensorFlow loop doing the same
  local steps (the same client graph and training loop, `local_training.LocalTrainer` on
  the same tf.data pipeline, one `tf.function` per virtual client called from a thread
  pool, clipping, sum and server step in TensorFlow), at 8, 32 and 128 virtual clients
  per round. TFF and plain rounds alternate so that load changes hit both. Wall time and
  CPU time (user + system of Python and its worker_binary children) are both reported:
  on a shared machine the CPU-time ratio is the steadier one, since other jobs' load
  stretches wall time and a process with more runnable threads gets a larger share of
  the cores. This section also gives round time and peak memory (RSS of Python plus its
  worker_binary children) vs clients per round, as ratios to the smallest round.
- `workers`: round time with 2 local TFF workers vs 1 (`runtime.RuntimeConfig`).
- `population`: round time and peak memory at 10x the users, same clients per round; and
  the loader's cost for a user at the start vs deep inside a part file (time and bytes
  the process read, from /proc/self/io), including a part of `max_part_bytes`.
- `flops`: achieved FLOP/s of local training vs the measured peak of this machine for
  the same ops (a large matmul and a large-batch convolution of the model's shape).
  FLOPs of one local step come from TensorFlow's profiler on the forward+backward graph,
  checked against an analytic count of the convolutions and dense layers.

The measurements run in a child process (`python -m bench.bench_speed --child SPEC OUT`)
so that memory figures do not include other benchmarks, and each setting gets fresh TFF
workers. Users' images come from a bank of rendered synthetic images reused across
users (rendering 10^5 PNGs would dominate the run; training cost does not depend on
pixel values), written with the partition job's own shard writer and production
defaults (16 shards, 64 MiB parts).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench import process_tree_memory, round_speed

_FULL = {
    "bank_identities": 2_000,
    "images_per_user": 5,
    "users": 2_000,
    "population_factor": 10,
    "users_per_virtual_client": 2,
    "clients_per_round": (8, 32, 128),
    "population_clients_per_round": 32,
    "workers_clients_per_round": 32,
    "rounds": 3,
    "flops_repeats": 30,
    "loader_deep_offset_bytes": 64 << 20,
}
_QUICK = {
    "bank_identities": 40,
    "images_per_user": 2,
    "users": 40,
    "population_factor": 10,
    "users_per_virtual_client": 2,
    "clients_per_round": (1, 2),
    "population_clients_per_round": 2,
    "workers_clients_per_round": 2,
    "rounds": 1,
    "flops_repeats": 3,
    "loader_deep_offset_bytes": 1 << 20,
}
_BATCH_SIZE = 16
_EMBEDDING_SIZE = 32
_NUM_SHARDS = 16
_MAX_PART_BYTES = 64 << 20


# ---------------------------------------------------------------- data (parent process)


def write_partition(directory: str, users: int, images_per_user: int, bank: list[bytes]) -> None:
    """A partition of `users` one-identity users, `images_per_user` images each from `bank`."""
    from beam_jobs import partition, schema

    by_shard = collections.defaultdict(list)
    for u in range(users):
        user_id, identity = f"user{u:07d}", f"identity{u:07d}"
        for i in range(images_per_user):
            image = bank[(u * images_per_user + i) % len(bank)]
            serialized = schema.serialize(schema.CanonicalRecord(user_id, identity, image))
            by_shard[partition.shard_of_user(user_id, _NUM_SHARDS)].append((user_id, serialized))
    os.makedirs(os.path.join(directory, partition.INDEX_DIR))
    counts = [
        partition.write_shard(directory, shard, items, _MAX_PART_BYTES)
        for shard, items in by_shard.items()
    ]
    with open(os.path.join(directory, partition.MANIFEST_FILE), "w") as f:
        json.dump(partition.build_manifest(counts, _NUM_SHARDS, _MAX_PART_BYTES), f)


def image_bank(identities: int, images_per_identity: int) -> list[bytes]:
    from beam_jobs import synthetic

    config = synthetic.SyntheticConfig(
        identities=identities, images_per_identity=images_per_identity, seed=0
    )
    return [r.image for r in synthetic.records_for_identities(config, 0, identities)]


# ------------------------------------------------------- measurement (child process)


def _cpu_seconds() -> float:
    """User + system CPU seconds so far of this process and its live descendants (the
    worker_binary processes, which live as long as a setting)."""
    import psutil

    process = psutil.Process()
    times = process.cpu_times()
    total = times.user + times.system
    for child in process.children(recursive=True):
        try:
            child_times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += child_times.user + child_times.system
    return total


def _train_config(clients_per_round: int, users_per_virtual_client: int):  # noqa: ANN202
    from tff_algorithms.config import job_config

    return job_config.TrainJobConfig(
        rounds=1_000,
        noise_multiplier=0.0,
        clip_norm=1.0,
        users_per_virtual_client=users_per_virtual_client,
        virtual_clients_per_round=clients_per_round,
        client_learning_rate=0.05,
        server_learning_rate=1.0,
        server_momentum=0.0,
        head_lr_scale=10.0,
        batch_size=_BATCH_SIZE,
        embedding_size=_EMBEDDING_SIZE,
        evaluate_every=0,
    )


@functools.cache
def _process(config):  # noqa: ANN001, ANN202 - a TrainJobConfig -> its TFF process
    """The DP-FedEmb process (noise 0) reading data from ids; one per configuration, since
    tracing it costs more than the rounds of a quick run. Settings that differ only in
    the population or the workers share it."""
    from tff_algorithms.algorithms.dp_fedemb import aggregators, client_work, processes
    from tff_algorithms.federated import client_data

    image_shape = config.image_shape
    return processes.build_fedemb_process(
        config.backbone_config,
        config.client_config(),
        aggregators.gaussian_fixed(
            noise_multiplier=0.0,
            clip_norm=config.clip_norm,
            virtual_clients_per_round=config.virtual_clients_per_round,
            noise_seed=0,
        ),
        processes.server_sgdm(config.server_learning_rate, 0.0),
        client_loader=client_work.ClientLoader(
            lambda vc_id: client_data.load_examples(vc_id, image_shape),
            seed_name=client_data.seed_name,
        ),
    )


class _Setting:
    """One federated setup: partition, schedule, the TFF process and its ids per round."""

    def __init__(self, partition_dir: str, clients_per_round: int, users_per_vc: int) -> None:
        from beam_jobs import partition
        from tff_algorithms.config import job_plan
        from tff_algorithms.federated import client_data

        self.config = _train_config(clients_per_round, users_per_vc)
        started = time.perf_counter()
        user_ids = partition.PartitionReader(partition_dir).user_ids()
        plan = job_plan.schedule_for(self.config, len(user_ids))
        self.ids = client_data.VirtualClientIds(partition_dir, plan, user_ids)
        self.setup_seconds = time.perf_counter() - started
        self.client_config = self.config.client_config()
        self.process = _process(self.config)

    def tff_round(self, state, round_num: int) -> tuple[object, float, float, float, int]:  # noqa: ANN001
        """(new state, seconds of the round, its CPU seconds, seconds of it spent building
        ids, examples)."""
        cpu_started = _cpu_seconds()
        started = time.perf_counter()
        ids = self.ids.for_round(round_num)
        ids_seconds = time.perf_counter() - started
        output = self.process.next(state, ids)
        seconds = time.perf_counter() - started
        return (
            output.state,
            seconds,
            _cpu_seconds() - cpu_started,
            ids_seconds,
            int(output.metrics["client_work"]["num_examples"]),
        )


class _PlainLoop:
    """The same local steps as a TFF round, in TensorFlow without TFF (module docstring)."""

    def __init__(self, setting: _Setting, initial_weights) -> None:  # noqa: ANN001
        import tensorflow as tf

        from tff_algorithms.algorithms.dp_fedemb import client_work, local_training
        from tff_algorithms.federated import client_data
        from tff_algorithms.modeling import models

        config, client_config = setting.config, setting.client_config
        self._ids = setting.ids
        self._clip = config.clip_norm
        self._clients = config.virtual_clients_per_round
        trainer = local_training.LocalTrainer(
            lambda: models.build_backbone(config.backbone_config), client_config, None
        )
        image_shape = config.image_shape

        train = tf.function(trainer.train)  # as in the TFF client computation

        @tf.function(autograph=False)
        def client_update(weights, virtual_client_id, round_num):  # noqa: ANN001, ANN202
            dataset = client_work.make_client_dataset(
                client_data.load_examples(virtual_client_id, image_shape),
                virtual_client_id,
                client_config,
            )
            client_state = collections.OrderedDict(
                round_num=round_num, head_seed=tf.constant(client_config.head_seed, tf.int64)
            )
            result, _ = train(weights, dataset, client_state)
            clipped, _ = tf.clip_by_global_norm(result.update, self._clip)
            return clipped

        @tf.function
        def apply_mean(trainable, update_sum):  # noqa: ANN001, ANN202
            # Server SGD with learning rate 1 on the mean update (TFF's update convention).
            return [w - s / self._clients for w, s in zip(trainable, update_sum)]

        self.client_update, self._apply_mean = client_update, apply_mean
        self.weights = initial_weights
        self._pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1)

    def round(self, round_num: int) -> tuple[float, float]:
        """(seconds of the round, its CPU seconds)."""
        import tensorflow as tf
        import tensorflow_federated as tff

        cpu_started = _cpu_seconds()
        started = time.perf_counter()
        round_tensor = tf.constant(round_num, tf.int64)
        # Clients run concurrently, one per core, as the TFF worker runs them: TensorFlow
        # releases the GIL, so threads keep every core busy.
        updates = self._pool.map(
            lambda vc_id: self.client_update(self.weights, tf.constant(vc_id), round_tensor),
            self._ids.for_round(round_num),
        )
        update_sum = None
        for update in updates:
            update_sum = (
                update if update_sum is None else [a + b for a, b in zip(update_sum, update)]
            )
        self.weights = tff.learning.models.ModelWeights(
            trainable=self._apply_mean(list(self.weights.trainable), update_sum),
            non_trainable=list(self.weights.non_trainable),
        )
        return time.perf_counter() - started, _cpu_seconds() - cpu_started

    def close(self) -> None:
        self._pool.shutdown()


def _as_tensors(weights):  # noqa: ANN001, ANN202
    import tensorflow as tf
    import tensorflow_federated as tff

    return tff.learning.models.ModelWeights(
        trainable=[tf.constant(w) for w in weights.trainable],
        non_trainable=[tf.constant(w) for w in weights.non_trainable],
    )


def _measure_setting(
    partition_dir: str,
    clients_per_round: int,
    users_per_vc: int,
    rounds: int,
    *,
    local_workers: int = 1,
    plain: bool = False,
) -> dict:
    """Warm-up round (compiles), then `rounds` measured rounds on fresh TFF workers."""
    from tff_algorithms.federated import runtime

    with process_tree_memory.PeakRss() as memory:
        setting = _Setting(partition_dir, clients_per_round, users_per_vc)
        loop = None
        with runtime.session(
            runtime.RuntimeConfig(local_workers=local_workers), handle_signals=False
        ):
            try:
                state = setting.process.initialize()
                started = time.perf_counter()
                state = setting.tff_round(state, 0)[0]
                first_round = time.perf_counter() - started
                if plain:
                    loop = _PlainLoop(
                        setting, _as_tensors(setting.process.get_model_weights(state))
                    )
                    loop.round(0)
                tff_seconds, tff_cpu, ids_seconds = [], [], []
                plain_seconds, plain_cpu, examples, load_averages = [], [], [], []
                for round_num in range(1, rounds + 1):
                    state, seconds, cpu, id_seconds, num_examples = setting.tff_round(
                        state, round_num
                    )
                    tff_seconds.append(seconds)
                    tff_cpu.append(cpu)
                    ids_seconds.append(id_seconds)
                    examples.append(num_examples)
                    if loop is not None:
                        seconds, cpu = loop.round(round_num)
                        plain_seconds.append(seconds)
                        plain_cpu.append(cpu)
                    load_averages.append(os.getloadavg()[0])
            finally:
                if loop is not None:
                    loop.close()
    peaks = {
        "total": round(memory.bytes / 2**20, 1),
        "python": round(memory.own_bytes / 2**20, 1),
        "workers": round(memory.descendants_bytes / 2**20, 1),
    }
    result = {
        "clients_per_round": clients_per_round,
        "users_per_round": clients_per_round * users_per_vc,
        "local_workers": local_workers,
        "examples_per_round": statistics.median(examples),
        "first_round_seconds": round(first_round, 3),
        "round_seconds": _summary(tff_seconds),
        "round_cpu_seconds": _summary(tff_cpu),
        "python_ids_seconds_per_round": _summary(ids_seconds),
        # Other jobs' load on a shared machine, sampled after each measured round.
        "load_average_1min": _summary(load_averages),
        "setup_seconds": round(setting.setup_seconds, 3),
        "peak_rss_mib": peaks,
    }
    if loop is not None:
        result["plain_round_seconds"] = _summary(plain_seconds)
        result["plain_round_cpu_seconds"] = _summary(plain_cpu)
        # Pairs measured back to back: the median of their ratios is robust to load drift.
        result["tff_over_plain"] = round(
            statistics.median(t / p for t, p in zip(tff_seconds, plain_seconds)), 3
        )
        result["tff_over_plain_cpu"] = round(
            statistics.median(t / p for t, p in zip(tff_cpu, plain_cpu)), 3
        )
        result["plain_client_update_traces"] = loop.client_update.experimental_get_tracing_count()
    return result


def _bytes_read() -> int | None:
    """Bytes this process has read through system calls so far (Linux), else None."""
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])
    except (OSError, StopIteration):
        return None


def _load_cost(user_range) -> dict:  # noqa: ANN001 - a client_data.UserByteRange
    """Best seconds to load one user's records, and the bytes the process read doing it."""
    import tensorflow as tf

    from tff_algorithms.federated import client_data

    virtual_client_id = tf.constant(client_data.virtual_client_id(0, 0, [user_range]))

    def load() -> list:
        return list(client_data.read_virtual_client_records(virtual_client_id))

    seconds = _best_seconds(load, repeats=5)
    before = _bytes_read()
    load()
    after = _bytes_read()
    return {
        "offset": user_range.offset,
        "length": user_range.length,
        "seconds": seconds,
        "bytes_read": None if before is None else after - before,
    }


def _loader_offsets(partition_dir: str, deep_offset_bytes: int, work_dir: str) -> dict:
    """The cost of loading one user at the start vs deep inside a part file.

    The users at the start and at the end of the largest part file of the partition;
    and the last of them copied behind `deep_offset_bytes` of other records (a part as
    large as the partition's `max_part_bytes` allows). The in-TFF loader seeks to a
    user's byte range (`client_data` module docstring), so time and bytes read should
    not grow with the offset."""
    import tensorflow as tf

    from beam_jobs import partition
    from tff_algorithms.federated import client_data

    reader = partition.PartitionReader(partition_dir)
    locations = {u: reader.location(u) for u in reader.user_ids()}
    sizes = collections.Counter()
    for location in locations.values():
        sizes[location.part_file] = max(
            sizes[location.part_file], location.offset + location.length
        )
    largest = max(sizes, key=sizes.get)
    in_part = sorted(
        (location.offset, user)
        for user, location in locations.items()
        if location.part_file == largest
    )
    path = os.path.join(os.path.abspath(partition_dir), largest)

    def user_range(user: str) -> client_data.UserByteRange:
        location = locations[user]
        return client_data.UserByteRange(path, location.offset, location.length, location.records)

    first, last = user_range(in_part[0][1]), user_range(in_part[-1][1])
    deep_path = os.path.join(work_dir, "deep-part")
    with tf.io.TFRecordWriter(deep_path) as writer:
        writer.write(b"\0" * (deep_offset_bytes - 16))  # one frame of other users' bytes
    with open(path, "rb") as f:
        f.seek(last.offset)
        user_bytes = f.read(last.length)
    with open(deep_path, "ab") as f:
        f.write(user_bytes)
    deep = client_data.UserByteRange(deep_path, deep_offset_bytes, last.length, last.records)
    result = {"part_file_bytes": sizes[largest]}
    for name, user in (("first", first), ("last", last), ("deep", deep)):
        result[name] = _load_cost(user)
    result["last_over_first"] = round(result["last"]["seconds"] / result["first"]["seconds"], 2)
    result["deep_over_first"] = round(result["deep"]["seconds"] / result["first"]["seconds"], 2)
    return result


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


def measure_flops(spec: dict) -> dict:
    """FLOPs of one local step (profiler, checked analytically) and measured peaks."""
    import tensorflow as tf

    from tff_algorithms.modeling import identity_heads, models

    config = _train_config(spec["flops_clients_per_round"], spec["users_per_virtual_client"])
    client_config = config.client_config()
    backbone = models.build_backbone(config.backbone_config)
    head = tf.Variable(tf.zeros([config.embedding_size, client_config.head_capacity]))
    variables = list(backbone.trainable_weights) + [head]
    batch = _BATCH_SIZE

    def loss_and_grads(images, labels):  # noqa: ANN001, ANN202
        with tf.GradientTape() as tape:
            logits = identity_heads.head_logits(
                backbone(images, training=True), head, labels, client_config.head_loss
            )
            loss = identity_heads.head_loss(logits, labels, tf.ones_like(labels, tf.bool))
        return loss, tape.gradient(loss, variables)

    image_spec = tf.TensorSpec([batch, *config.image_shape], tf.float32)
    label_spec = tf.TensorSpec([batch], tf.int32)
    graph = tf.function(loss_and_grads).get_concrete_function(image_spec, label_spec).graph
    profile = tf.compat.v1.profiler.profile(
        graph,
        options=tf.compat.v1.profiler.ProfileOptionBuilder(
            tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
        )
        .with_empty_output()
        .build(),
    )
    profiled = int(profile.total_float_ops)
    analytic = _analytic_step_flops(backbone, client_config.head_capacity, batch)

    step = tf.function(loss_and_grads)
    images = tf.random.stateless_uniform([batch, *config.image_shape], [1, 2])
    labels = tf.zeros([batch], tf.int32)
    # Best of many short runs for every rate, so that all get the same chance of a quiet
    # moment on a shared machine.
    repeats = spec["flops_repeats"]
    local_step_seconds = _best_seconds(lambda: step(images, labels)[0].numpy(), repeats)
    # The same step at a large batch: the best this machine does on these exact ops.
    large_batch = 128
    large_images = tf.random.stateless_uniform([large_batch, *config.image_shape], [1, 2])
    large_labels = tf.zeros([large_batch], tf.int32)
    large_step_seconds = _best_seconds(lambda: step(large_images, large_labels)[0].numpy(), repeats)

    n = 1024
    a = tf.random.stateless_normal([n, n], [3, 4])
    b = tf.random.stateless_normal([n, n], [5, 6])
    matmul = tf.function(lambda: tf.reduce_sum(tf.matmul(a, b)))
    matmul_flops = 2 * n**3
    conv = next(
        layer
        for layer in backbone.layers
        if isinstance(layer, tf.keras.layers.Conv2D)
        and layer.filters
        == max(c.filters for c in backbone.layers if isinstance(c, tf.keras.layers.Conv2D))
    )
    _, h, w, c_in = conv.input.shape
    conv_batch = 64
    conv_input = tf.random.stateless_uniform([conv_batch, h, w, c_in], [7, 8])
    conv_op = tf.function(lambda: tf.reduce_sum(conv(conv_input)))
    conv_flops = conv_batch * _conv_flops(conv)
    matmul_seconds = _best_seconds(lambda: matmul().numpy(), repeats)
    conv_seconds = _best_seconds(lambda: conv_op().numpy(), repeats)
    return {
        "batch_size": batch,
        "step_flops_profiler": profiled,
        "step_flops_analytic": analytic,
        "profiler_over_analytic": round(profiled / analytic, 4),
        "flops_per_example": profiled / batch,
        "local_step_flops_per_s": profiled / local_step_seconds,
        "large_batch": large_batch,
        "large_batch_step_flops_per_s": profiled / batch * large_batch / large_step_seconds,
        "peak_matmul_flops_per_s": matmul_flops / matmul_seconds,
        "peak_conv_flops_per_s": conv_flops / conv_seconds,
        "peak_conv_shape": [conv_batch, int(h), int(w), int(c_in), conv.filters],
        "matmul_size": n,
    }


def _conv_flops(layer) -> int:  # noqa: ANN001
    """Multiply-adds x 2 of one example through a Conv2D layer."""
    _, out_h, out_w, out_c = layer.output.shape
    kernel_h, kernel_w, in_c, _ = layer.kernel.shape
    return 2 * out_h * out_w * out_c * kernel_h * kernel_w * in_c


def _analytic_step_flops(backbone, head_rows: int, batch: int) -> int:  # noqa: ANN001
    """Forward F of the convolutions and matmuls; backward 2F (input and weight gradients)
    minus the input gradient of the first layer, which needs none (the image is constant)."""
    import tensorflow as tf

    forward, first = 0, None
    for layer in backbone.layers:
        if isinstance(layer, tf.keras.layers.Conv2D):
            flops = _conv_flops(layer)
        elif isinstance(layer, tf.keras.layers.Dense):
            flops = 2 * layer.kernel.shape[0] * layer.kernel.shape[1]
        else:
            continue
        first = flops if first is None else first
        forward += flops
    forward += 2 * int(backbone.output_shape[-1]) * head_rows
    return batch * (3 * forward - first)


def _best_seconds(function, repeats: int) -> float:  # noqa: ANN001
    function()  # traces and warms up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def _child(spec: dict) -> dict:
    k, rounds = spec["users_per_virtual_client"], spec["rounds"]
    overhead = [
        _measure_setting(spec["base_partition"], m, k, rounds, plain=True)
        for m in spec["clients_per_round"]
    ]
    by_clients = {setting["clients_per_round"]: setting for setting in overhead}
    # One worker: the overhead run at the same clients per round.
    workers = [
        by_clients[spec["workers_clients_per_round"]],
        _measure_setting(
            spec["base_partition"],
            spec["workers_clients_per_round"],
            k,
            rounds,
            local_workers=2,
        ),
    ]
    population = [
        _measure_setting(path, spec["population_clients_per_round"], k, rounds)
        for path in (spec["base_partition"], spec["large_partition"])
    ]
    loader = _loader_offsets(
        spec["large_partition"], spec["loader_deep_offset_bytes"], spec["work_dir"]
    )
    flops = measure_flops({**spec, "flops_clients_per_round": spec["clients_per_round"][0]})
    rounds = round_speed.measure(
        spec["round_partition"], spec["work_dir"], spec["round_speed"], measured_peak(flops)
    )
    return {
        "round_speed": rounds,
        "overhead": overhead,
        "workers": workers,
        "population": population,
        "loader": loader,
        "flops": flops,
    }


# ----------------------------------------------------------------- report (parent)


def measured_peak(flops: dict) -> float:
    """This machine's measured peak: the best rate of the `_flops` measurements."""
    return max(
        flops["peak_matmul_flops_per_s"],
        flops["peak_conv_flops_per_s"],
        flops["large_batch_step_flops_per_s"],
    )


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3)


def _report(raw: dict, sizes: dict) -> dict:
    overhead, workers, population, flops = (
        raw["overhead"],
        raw["workers"],
        raw["population"],
        raw["flops"],
    )
    smallest = overhead[0]
    clients_scaling = [
        {
            "clients_per_round": s["clients_per_round"],
            "clients_ratio": s["clients_per_round"] / smallest["clients_per_round"],
            "round_seconds_ratio": _ratio(
                s["round_seconds"]["median"], smallest["round_seconds"]["median"]
            ),
            "peak_rss_total_ratio": _ratio(
                s["peak_rss_mib"]["total"], smallest["peak_rss_mib"]["total"]
            ),
            "peak_rss_workers_ratio": _ratio(
                s["peak_rss_mib"]["workers"], smallest["peak_rss_mib"]["workers"]
            ),
        }
        for s in overhead
    ]
    small, large = population
    achieved = [
        {
            "clients_per_round": s["clients_per_round"],
            "tff_flops_per_s": s["examples_per_round"]
            * flops["flops_per_example"]
            / s["round_seconds"]["median"],
            "plain_flops_per_s": s["examples_per_round"]
            * flops["flops_per_example"]
            / s["plain_round_seconds"]["median"],
        }
        for s in overhead
    ]
    peak = measured_peak(flops)
    for row in achieved:
        row["tff_over_peak"] = round(row["tff_flops_per_s"] / peak, 4)
        row["plain_over_peak"] = round(row["plain_flops_per_s"] / peak, 4)
    return {
        "federation_overhead": {
            "baseline": "plain TensorFlow: same client graph and training loop per virtual "
            "client in a tf.function, clients on a thread pool, clip + mean + server step in "
            "TensorFlow",
            "settings": overhead,
            "tff_over_plain": {str(s["clients_per_round"]): s["tff_over_plain"] for s in overhead},
            "tff_over_plain_cpu": {
                str(s["clients_per_round"]): s["tff_over_plain_cpu"] for s in overhead
            },
        },
        "clients_per_round_scaling": clients_scaling,
        "workers": {
            "settings": workers,
            "two_over_one_round_seconds": _ratio(
                workers[1]["round_seconds"]["median"], workers[0]["round_seconds"]["median"]
            ),
        },
        "population": {
            "settings": population,
            "users": [sizes["users"], sizes["users"] * sizes["population_factor"]],
            "round_seconds_ratio": _ratio(
                large["round_seconds"]["median"], small["round_seconds"]["median"]
            ),
            "peak_rss_total_ratio": _ratio(
                large["peak_rss_mib"]["total"], small["peak_rss_mib"]["total"]
            ),
            "peak_rss_workers_ratio": _ratio(
                large["peak_rss_mib"]["workers"], small["peak_rss_mib"]["workers"]
            ),
            "loader": raw["loader"],
        },
        "flops": {
            **flops,
            "peak_flops_per_s": peak,
            "local_step_over_peak": round(flops["local_step_flops_per_s"] / peak, 4),
            "achieved": achieved,
        },
    }


def run(out_dir: str, quick: bool) -> dict:
    sizes = _QUICK if quick else _FULL
    work = tempfile.mkdtemp(prefix="bench_speed_")
    try:
        bank = image_bank(sizes["bank_identities"], sizes["images_per_user"])
        base = os.path.join(work, "base")
        large = os.path.join(work, "large")
        started = time.perf_counter()
        write_partition(base, sizes["users"], sizes["images_per_user"], bank)
        write_partition(
            large, sizes["users"] * sizes["population_factor"], sizes["images_per_user"], bank
        )
        round_sizes = round_speed.sizes(quick)
        round_partition = os.path.join(work, "round")
        write_partition(round_partition, round_sizes["users"], round_speed.IMAGES_PER_USER, bank)
        data_seconds = time.perf_counter() - started
        spec = {
            "round_partition": round_partition,
            "round_speed": round_sizes,
            **{k: v for k, v in sizes.items() if k != "clients_per_round"},
            "clients_per_round": list(sizes["clients_per_round"]),
            "base_partition": base,
            "large_partition": large,
            "work_dir": work,
        }
        spec_path, result_path = os.path.join(work, "spec.json"), os.path.join(work, "raw.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        subprocess.run(
            [sys.executable, "-m", "bench.bench_speed", "--child", spec_path, result_path],
            check=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        with open(result_path) as f:
            raw = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = round_speed.write_summary(out_dir, raw["round_speed"], round_sizes, quick)
    return {
        "quick": quick,
        "round_speed": {**raw["round_speed"], "summary": summary},
        "sizes": {**sizes, "clients_per_round": list(sizes["clients_per_round"])},
        "model": {
            "architecture": "small_cnn",
            "image": [28, 28, 1],
            "embedding_size": _EMBEDDING_SIZE,
            "batch_size": _BATCH_SIZE,
        },
        "data_seconds": round(data_seconds, 1),
        **_report(raw, sizes),
    }


def _main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "--child":
        with open(argv[2]) as f:
            spec = json.load(f)
        result = _child(spec)
        with open(argv[3], "w") as f:
            json.dump(result, f)
        return 0
    print("usage: python -m bench.bench_speed --child SPEC_JSON RESULT_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
