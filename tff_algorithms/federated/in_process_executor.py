"""The `in_process` executor (`runtime.executor`): a round's TFF computation run by this
process's own TensorFlow, without `worker_binary`.

The algorithm stays one TFF computation (the process's `next`); nothing here knows
which algorithm it is. TFF lowers `next` into its MapReduceForm
(`tff.backends.mapreduce.get_map_reduce_form_for_computation`): plain TensorFlow
graphs for `prepare` (server state -> what clients receive), `work` (one virtual
client), `zero`/`accumulate`/`merge`/`report` (the aggregation) and `update` (the
server update, where the aggregators draw their DP noise from the seeds in the state).
`InProcessContext` runs them as TFF's own executor would:

* `prepare` once; `work` once per virtual client, several at a time, each on a
  session of its own, spread round-robin over the devices TensorFlow sees
  (`client_devices`: every GPU, else the CPU); its `intra_op_threads` as a local
  worker's;
* the clients' updates accumulated in client order on the host CPU (so a run is
  reproducible: same order, same float sums), then `report` and `update` on the host
  CPU, so the noise is the same draw as the worker's, from the same seeds, once.

Computations that are not a round run as plain TensorFlow too: a TensorFlow
computation (`get_model_weights`) as it is, a server-only one (`initialize`) after
TFF reduces it to TensorFlow. What TFF's forms cannot express (two aggregations in one
round, such as over-selection's first-M reports; secure sums; client datasets passed
as values) is refused in one line naming `runtime.executor`. A form is compiled once
per process and computation (`compiled_rounds`, keyed by a hash of the computation's
serialized proto): a job's rounds share its `next`'s; how long TFF took is logged and
kept (`CompiledRound.compile_seconds`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf
import tensorflow_federated as tff
from absl import logging
from tensorflow_federated.proto.v0 import computation_pb2
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.backends.mapreduce import compiler as mapreduce_compiler
from tensorflow_federated.python.core.backends.mapreduce import forms
from tensorflow_federated.python.core.environments.tensorflow_backend import (
    tensorflow_tree_transformations,
)
from tensorflow_federated.python.core.environments.tensorflow_frontend import (
    tensorflow_computation,
)
from tensorflow_federated.python.core.impl.compiler import building_blocks
from tensorflow_federated.python.core.impl.computation import computation_impl
from tensorflow_federated.python.core.impl.types import type_conversions, type_serialization
from tensorflow_federated.python.core.impl.utils import tensorflow_utils
from tensorflow_federated.python.tensorflow_libs import serialization_utils

HOST_DEVICE = "/device:CPU:0"
SETTING = "runtime.executor"


class UnsupportedComputation(ValueError):
    """A computation the in-process executor cannot run (one line naming the setting)."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{SETTING} in_process cannot run this computation: {what}; "
            f"set {SETTING} to worker (--executor worker)"
        )


def client_devices() -> list[str]:
    """Where virtual clients' work runs: every GPU TensorFlow sees, else the host CPU."""
    gpus = [device.name for device in tf.config.list_logical_devices("GPU")]
    return gpus or [HOST_DEVICE]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Graph:
    """One TFF TensorFlow computation as a TensorFlow graph on one device, with a pool of
    sessions (one per concurrent call, each with its own variables)."""

    def __init__(
        self,
        proto: computation_pb2.Computation,
        device: str,
        intra_op_threads: int,
        cpu_devices: int = 1,
    ) -> None:
        self._tf = proto.tensorflow
        self.type_signature = type_serialization.deserialize_type(proto.type)
        self._graph = tf.Graph()
        graph_def = serialization_utils.unpack_graph_def(self._tf.graph_def)
        with self._graph.as_default(), tf.device(device):
            tf.graph_util.import_graph_def(graph_def, name="")
        self.device = device
        self._parameter = self._tf.parameter if self.type_signature.parameter is not None else None
        self._fetches = tensorflow_utils.extract_tensor_names_from_binding(self._tf.result)
        self._config = tf.compat.v1.ConfigProto(
            allow_soft_placement=True,  # string and file ops of a GPU graph stay on the CPU
            intra_op_parallelism_threads=intra_op_threads,
            inter_op_parallelism_threads=intra_op_threads,
            use_per_session_threads=intra_op_threads > 0,
            device_count={"CPU": cpu_devices},
        )
        self._config.gpu_options.allow_growth = True
        self._sessions: queue.SimpleQueue[tf.compat.v1.Session] = queue.SimpleQueue()
        self._all_sessions: list[tf.compat.v1.Session] = []
        self._lock = threading.Lock()

    @property
    def graph(self) -> tf.Graph:
        return self._graph

    def _session(self) -> tf.compat.v1.Session:
        try:
            return self._sessions.get_nowait()
        except queue.Empty:
            session = tf.compat.v1.Session(graph=self._graph, config=self._config)
            with self._lock:
                self._all_sessions.append(session)
            return session

    def __call__(self, arg: Any = None) -> Any:
        feeds: dict[str, Any] = {}
        if self._parameter is not None:
            _feed(self._parameter, arg, feeds)
        session = self._session()
        try:
            if self._tf.session_token_tensor_name:
                feeds[self._tf.session_token_tensor_name] = str(id(session))
            # A fresh call each time, as a pure function: the computation's own
            # variables start from their initializers.
            if self._tf.initialize_op:
                session.run(self._tf.initialize_op, feed_dict=feeds)
            values = session.run(self._fetches, feed_dict=feeds) if self._fetches else []
        finally:
            self._sessions.put(session)
        return _assemble(self._tf.result, self.type_signature.result, iter(values))

    def close(self) -> None:
        with self._lock:
            sessions, self._all_sessions = self._all_sessions, []
        for session in sessions:
            session.close()


def _elements(value: Any) -> list[Any]:
    if isinstance(value, structure.Struct):
        return [v for _, v in structure.iter_elements(value)]
    try:
        container = structure.from_container(value)
    except TypeError:
        raise UnsupportedComputation(
            f"a value of type {type(value).__name__} where a structure was expected"
        ) from None
    return [v for _, v in structure.iter_elements(container)]


def _feed(binding: computation_pb2.TensorFlow.Binding, value: Any, feeds: dict) -> None:
    kind = binding.WhichOneof("binding")
    if kind == "tensor":
        feeds[binding.tensor.tensor_name] = value
    elif kind == "struct":
        values = _elements(value)
        if len(values) != len(binding.struct.element):
            raise ValueError(
                f"in-process executor: a value of {len(values)} elements for a structure "
                f"of {len(binding.struct.element)}"
            )
        for element, element_value in zip(binding.struct.element, values):
            _feed(element, element_value, feeds)
    else:
        raise UnsupportedComputation(f"a {kind} value (pass virtual-client ids, not datasets)")


def _assemble(
    binding: computation_pb2.TensorFlow.Binding, type_spec: Any, values: Iterator[Any]
) -> Any:
    kind = binding.WhichOneof("binding")
    if kind == "tensor":
        return next(values)
    if kind == "struct":
        return structure.Struct(
            [
                (name, _assemble(element, element_type, values))
                for (name, element_type), element in zip(
                    structure.iter_elements(type_spec), binding.struct.element
                )
            ]
        )
    raise UnsupportedComputation(f"a {kind} result")


def _pair(first: Any, second: Any) -> structure.Struct:
    return structure.Struct([(None, first), (None, second)])


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


def _proto(comp: Any) -> computation_pb2.Computation:
    return comp.to_building_block().proto


def _is_empty(type_spec: Any) -> bool:
    return isinstance(type_spec, tff.StructType) and not any(
        not _is_empty(t) for _, t in structure.iter_elements(type_spec)
    )


@dataclasses.dataclass
class CompiledRound:
    """A round's MapReduceForm as graphs: `work` on each client device, the rest on the
    host CPU; `compile_seconds`: how long TFF took to lower it; `last_round_seconds`:
    where the last round's time went (prepare, client_work, aggregation, server_update)."""

    form: forms.MapReduceForm
    compile_seconds: float
    server: dict[str, _Graph]
    work: list[_Graph]
    last_round_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def close(self) -> None:
        for graph in [*self.server.values(), *self.work]:
            graph.close()


_SERVER_PIECES = ("prepare", "zero", "accumulate", "merge", "report", "update")


def _lower_round(comp: Any) -> forms.MapReduceForm:
    try:
        form = tff.backends.mapreduce.get_map_reduce_form_for_computation(comp)
    except (mapreduce_compiler.MapReduceFormCompilationError, TypeError, ValueError) as e:
        # The first line says what TFF could not lower (e.g. a second aggregation).
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedComputation(
            f"TFF's MapReduceForm cannot express this round ({reason[:200]})"
        ) from None
    secure = [
        name
        for name, index in (
            ("secure_sum_bitwidth", 1),
            ("secure_sum", 2),
            ("secure_modular_sum", 3),
        )
        if not _is_empty(form.work.type_signature.result[index])
    ]
    if secure:
        raise UnsupportedComputation(
            f"the round aggregates with federated_{secure[0]}, which runs only on workers"
        )
    return form


class InProcessContext(tff.framework.SyncContext):
    """The TFF execution context of `runtime.executor` in_process (module docstring).

    Args:
      intra_op_threads: threads one op of a client's work may use (0: TensorFlow's
        default), as `RuntimeConfig.worker_intra_op_threads` for a local worker.
      concurrent_clients: virtual clients whose work runs at once per client device;
        0: the cores on a CPU, 2 per GPU (one loading while one computes).
      devices: where client work runs, round-robin; None: `client_devices()`. Several
        CPU devices ("/device:CPU:1") are virtual ones of one session, which is how
        the spreading is checked without GPUs.
    """

    def __init__(
        self,
        intra_op_threads: int = 1,
        concurrent_clients: int = 0,
        devices: Sequence[str] | None = None,
    ) -> None:
        self._intra_op_threads = intra_op_threads
        self._devices = list(devices or client_devices())
        on_gpu = any("GPU" in device.upper() for device in self._devices)
        per_device = concurrent_clients or (2 if on_gpu else _cores())
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=per_device * len(self._devices), thread_name_prefix="in_process_client"
        )
        logging.info(
            "in_process executor: client work on %s, %d virtual clients at a time on each",
            ", ".join(self._devices),
            per_device,
        )
        self._local: dict[str, _Graph] = {}
        self._lock = threading.Lock()

    @property
    def devices(self) -> list[str]:
        return list(self._devices)

    def invoke(self, comp: Any, arg: Any) -> Any:
        type_signature = comp.type_signature
        if arg is not None:
            arg = tensorflow_computation.transform_args(arg)
        if _is_round(type_signature):
            result = self._run_round(self.compiled_round(comp), type_signature, arg)
        else:
            result = self._local_graph(comp)(arg)
        result = type_conversions.type_to_py_container(result, type_signature.result)
        return tensorflow_computation.transform_result(result)

    def compiled_round(self, comp: Any) -> CompiledRound:
        """`comp`'s MapReduceForm as graphs, compiled on first use in this process."""
        key = (_key(comp), tuple(self._devices), self._intra_op_threads)
        with self._lock:
            compiled = _COMPILED.get(key)
            if compiled is None:
                began = time.perf_counter()
                form = _lower_round(comp)
                seconds = time.perf_counter() - began
                logging.info("TFF compiled the round to MapReduceForm in %.1f s", seconds)
                compiled = _graphs_of(form, seconds, self._devices, self._intra_op_threads)
                _COMPILED[key] = compiled
        return compiled

    def _local_graph(self, comp: Any) -> _Graph:
        key = _key(comp)
        with self._lock:
            graph = self._local.get(key)
            if graph is None:
                graph = _Graph(_local_tensorflow(comp), HOST_DEVICE, 0)
                self._local[key] = graph
        return graph

    def _run_round(self, compiled: CompiledRound, type_signature: Any, arg: Any) -> Any:
        state, client_values = _elements(arg)
        server = compiled.server
        clock = _Clock()
        broadcast = server["prepare"](state)
        clients = list(client_values)
        clock.lap("prepare")

        def work(index: int) -> Any:
            graph = compiled.work[index % len(compiled.work)]
            return graph(_pair(clients[index], broadcast))

        # In client order, whatever order they finish in: the sums are reproducible.
        updates = [result[0] for result in self._pool.map(work, range(len(clients)))]
        clock.lap("client_work")
        accumulator = server["zero"]()
        for update in updates:
            accumulator = server["accumulate"](_pair(accumulator, update))
        aggregate = server["report"](accumulator)
        clock.lap("aggregation")
        no_secure_sum = (None, structure.Struct([]))
        aggregates = structure.Struct([(None, aggregate), *[no_secure_sum] * 3])
        new_state, output = _elements(server["update"](_pair(state, aggregates)))
        clock.lap("server_update")
        compiled.last_round_seconds = clock.laps
        names = [name for name, _ in structure.iter_elements(type_signature.result)]
        return structure.Struct(list(zip(names, (new_state, output))))

    def close(self) -> None:
        """Stops the client threads and closes this context's local graphs' sessions
        (compiled rounds stay cached for the process)."""
        self._pool.shutdown(wait=True)
        with self._lock:
            graphs, self._local = list(self._local.values()), {}
        for graph in graphs:
            graph.close()


# Compiled once per process, computation, client devices and threads: every round of a
# job reuses its `next`'s lowering. (A second job builds its `next` anew, and TFF's
# tracing names differ between builds, so it compiles again.)
_COMPILED: dict[tuple[str, tuple[str, ...], int], CompiledRound] = {}


def compiled_rounds() -> list[CompiledRound]:
    """The rounds compiled in this process, oldest first."""
    return list(_COMPILED.values())


def _graphs_of(
    form: forms.MapReduceForm, seconds: float, devices: Sequence[str], intra_op_threads: int
) -> CompiledRound:
    server = {name: _Graph(_proto(getattr(form, name)), HOST_DEVICE, 0) for name in _SERVER_PIECES}
    cpus = 1 + max((int(d.rsplit(":", 1)[1]) for d in devices if "CPU" in d.upper()), default=0)
    work = [_Graph(_proto(form.work), device, intra_op_threads, cpus) for device in devices]
    return CompiledRound(form, seconds, server, work)


def _key(comp: Any) -> str:
    """The computation's identity: a hash of its serialized proto, so that the same
    computation object (or an identical one) reuses what was compiled for it. Kept per
    object (hashing `next` takes ~30 ms, and every round asks twice); the entry holds the
    object, so its id is not reused while the entry lives."""
    held = _KEYS.get(id(comp))
    if held is not None and held[0] is comp:
        return held[1]
    if isinstance(comp, computation_impl.ConcreteComputation):
        proto = computation_impl.ConcreteComputation.get_proto(comp)  # no re-serialization
    else:
        proto = _proto(comp)
    key = hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()
    _KEYS[id(comp)] = (comp, key)
    return key


_KEYS: dict[int, tuple[Any, str]] = {}


def _is_round(type_signature: Any) -> bool:
    """(state@SERVER, data@CLIENTS) -> (state@SERVER, output@SERVER): what MapReduceForm
    lowers."""
    parameter = type_signature.parameter
    if not isinstance(parameter, tff.StructType) or len(parameter) != 2:
        return False
    first, second = parameter[0], parameter[1]
    return (
        isinstance(first, tff.FederatedType)
        and first.placement is tff.SERVER
        and isinstance(second, tff.FederatedType)
        and second.placement is tff.CLIENTS
    )


def _local_tensorflow(comp: Any) -> computation_pb2.Computation:
    """A computation that is not a round as one TensorFlow computation: as it is, or a
    server-only one reduced by TFF (as `get_state_initialization_computation` does)."""
    proto = _proto(comp)
    if proto.WhichOneof("computation") == "tensorflow":
        return proto
    if _places_clients(comp.type_signature):
        raise UnsupportedComputation(
            "a computation over clients that is not a round (state@SERVER, data@CLIENTS)"
        )
    try:
        tree, _ = tensorflow_tree_transformations.replace_intrinsics_with_bodies(
            comp.to_building_block()
        )
        tree = mapreduce_compiler.consolidate_and_extract_local_processing(
            tree, tf.compat.v1.ConfigProto()
        )
    except (mapreduce_compiler.MapReduceFormCompilationError, TypeError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedComputation(
            f"TFF cannot reduce it to TensorFlow ({reason[:200]})"
        ) from None
    if not isinstance(tree, building_blocks.CompiledComputation):
        raise UnsupportedComputation("TFF did not reduce it to one TensorFlow computation")
    return tree.proto


def _places_clients(type_spec: Any) -> bool:
    return any(
        isinstance(t, tff.FederatedType) and t.placement is tff.CLIENTS
        for t in _walk_types(type_spec)
    )


def _walk_types(type_spec: Any) -> Iterator[Any]:
    yield type_spec
    if isinstance(type_spec, tff.FunctionType):
        if type_spec.parameter is not None:
            yield from _walk_types(type_spec.parameter)
        yield from _walk_types(type_spec.result)
    elif isinstance(type_spec, tff.StructType):
        for _, element in structure.iter_elements(type_spec):
            yield from _walk_types(element)
    elif isinstance(type_spec, tff.FederatedType):
        yield from _walk_types(type_spec.member)
