#!/usr/bin/env python
"""Communication per step on several logical CPU devices, measured.

For one backend (``KERAS_BACKEND``) and each R in ``--replicas``, a fresh
process with R logical CPU devices trains ``PerExampleModel`` on an MLP 5-32-3
(P = 291 parameters) with a global batch of B = 32, under the engine Keras
distributes with, and prints one row per rule: the engine path, the collectives
of one step (count per kind), the bytes they move per step per device, the
documented formula (docs/, 'Communication per step') and the median step time::

    python benchmarks/bench.py --replicas 2,4    # JAX and TensorFlow (the docs' table)
    python benchmarks/replicas.py --replicas 2,4 # the same
    KERAS_BACKEND=jax python benchmarks/replicas.py --replicas 2 --rules mean,krum

- JAX: ``XLA_FLAGS=--xla_force_host_platform_device_count=R``,
  ``keras.distribution.DataParallel``. The collectives are read from the
  compiled per-device program of Keras's jitted train step
  (``jit.lower(state, batch).compile().as_text()``, the state and the batch
  placed as ``fit()`` places them): ``all-reduce``, ``all-gather``,
  ``all-to-all``, ``collective-permute``, ``reduce-scatter`` (and their async
  ``-done`` halves); bytes are the sizes of their result buffers. A collective
  inside a ``while`` loop counts once per iteration when XLA knows the trip
  count, else once (marked ``loop?``).
- TensorFlow: R logical CPU devices and ``tf.distribute.MirroredStrategy``
  (whose cross-device ops on CPUs are collective ops). The bytes are measured
  at run time (:class:`TFCounter`): the functions of
  ``tensorflow.python.ops.collective_ops`` that ``tf.distribute`` builds its
  collectives with are wrapped, the train function is traced again with a host
  callback after each collective on replica 0's device, and one step records
  the size of every collective's actual output (an all-gather of shards that
  may be uneven is two collectives in TF: the shards' shapes, then the shards
  padded to the largest). The graph's ``Collective*`` ops on replica 0 are
  counted too (:func:`tf_collectives`): a row is an error if the counter missed
  one. The logs Keras averages over the replicas (``reduce_per_replica``: a
  ``Mean`` of the R scalars) and the iteration counter are implicit copies, not
  collectives, and are not counted. The timed steps run without the callbacks.
  A rule ``pergrad`` refuses on several replicas is a ``refused: <message>`` row.

The bytes are what the step's collectives produce on each device (an
all-gather's result is the whole gathered array, the device's own part
included), not the wire traffic of a particular all-reduce algorithm.
Times are medians over the timed steps, but R logical devices share this
machine's cores: they are not a speed measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "src")

#: the MLP 5-32-3: (d_in, d_out) per Dense layer
LAYERS = ((5, 32), (32, 3))
BATCH = 32
#: geometric_median()'s default max_iter
GEOMED_ITERATIONS = 10
RULES = (
    "mean", "clip", "automatic_clip", "dp_gaussian", "norm_filter", "centered_clip", "krum",
    "geometric_median", "median", "trimmed_mean", "bucketing",
)
#: what each rule name builds (in the child, once pergrad is imported)
RULE_SOURCE = {
    "mean": "aggregators.mean()",
    "clip": "aggregators.clip(1.0)",
    "automatic_clip": "aggregators.automatic_clip()",
    "dp_gaussian": "privacy.dp_gaussian(1.0, 1.0, seed=0)",
    "norm_filter": "aggregators.norm_filter(3.0)",
    "centered_clip": "aggregators.centered_clip(1.0)",
    "krum": "aggregators.krum(0.25)",
    "geometric_median": "aggregators.geometric_median()",
    "median": "aggregators.median()",
    "trimmed_mean": "aggregators.trimmed_mean(0.25)",
    "bucketing": "aggregators.bucketing(2, aggregators.median(), seed=0)",
}
KINDS = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}


# --------------------------------------------------------------------------------------
# formulas (docs/, 'Communication per step')


def formula(rule: str, replicas: int, backend: str) -> tuple[str, int]:
    """The documented bytes per step per device, as text and as a number for this model.

    Leading terms, float32 (4 bytes a value): the measured bytes add a few
    scalars (the loss, flags), ``O(B)`` vectors and integer indices and, on
    TensorFlow, the shapes each all-gather exchanges first (``R x rank``
    int32). TensorFlow: what each of the three ways of ``pergrad.distributed.replicas``
    gathers (docs/). JAX: what XLA's partitioner inserts.
    """
    p = sum(i * o + o for i, o in LAYERS)
    b, r, t = BATCH, replicas, GEOMED_ITERATIONS
    rows = sum(i + o for i, o in LAYERS)  # sum_l (d_in + d_out)
    rows_bias = sum(i + 2 * o for i, o in LAYERS)  # with the bias gradients' rows
    (d0, d1), (_, d2) = LAYERS  # the widths of the MLP d0-d1-d2
    coordinates = 4 * b * (d0 + d2) + 12 * b * d1 // r + 4 * (p - d2) + 4 * b * d2
    if backend == "tensorflow":
        v = 2 * len(LAYERS)  # variables: a kernel and a bias per Dense layer
        a_d = ("4B·Σ(d_in+d_out) + 4P", 4 * b * rows + 4 * p)  # each layer's A and D rows
        table = {  # the gradient and the shard size (pergrad.distributed.replicas.local_fraction)
            "mean": ("4(P + 1)", 4 * (p + 1)),
            "automatic_clip": ("4(P + 1)", 4 * (p + 1)),
            "dp_gaussian": ("4(P + 1)", 4 * (p + 1)),
            "clip": ("4(P + 3)", 4 * (p + 3)),  # + the clipped-fraction counts
            # gathered statistics: the B x V per-example norms, then the gradient
            "norm_filter": ("4BV + 4P", 4 * b * v + 4 * p),
            # + each layer's A and D rows (every replica forms the B x B Gram matrix)
            "krum": ("4B·Σ(d_in+d_out) + 4BV + 4P", 4 * b * rows + 4 * b * v + 4 * p),
            "geometric_median": ("4B·Σ(d_in+d_out) + 4BV + 4P",
                                 4 * b * rows + 4 * b * v + 4 * p),
            # whole batch, streaming: each layer's A and D rows
            "median": a_d, "trimmed_mean": a_d, "bucketing": a_d,
            # whole batch, materialized: every per-example gradient
            "centered_clip": ("4BP + 4P", 4 * b * p + 4 * p),
        }
        return table[rule]
    table = {  # the gradient and the loss
        "mean": ("4(P + 1)", 4 * (p + 1)),
        "automatic_clip": ("4(P + 1)", 4 * (p + 1)),
        "dp_gaussian": ("4(P + 1)", 4 * (p + 1)),
        "clip": ("4(P + 2)", 4 * (p + 2)),  # + the clipped fraction
        "norm_filter": ("4P + 4B", 4 * p + 4 * b),  # + the B norms
        "centered_clip": ("4P", 4 * p),
        # the A and D rows of the batch, the B x B distances (each device computes B/R rows)
        "krum": ("4B·Σ(d_in+d_out) + 4B² + 4P", 4 * b * rows + 4 * b * b + 4 * p),
        # the A and D rows, then a B-vector per Weiszfeld iteration (T = max_iter)
        "geometric_median": ("4B·Σ(d_in+d_out) + 4TB + 4P", 4 * b * rows + 4 * t * b + 4 * p),
        # coordinate rules (layouts.spread_coordinates: both kernels and the first bias
        # split over the d1 hidden units; the A and D rows kept by example,
        # layouts.by_example): the input rows and the output-gradient rows all-gathered,
        # the hidden rows (three tensors) all-to-all'd to each device's units, each
        # device's part of the result all-gathered; the last bias (d2 = 3 coordinates, R
        # does not divide them) stays by example: its B x d2 values all-reduced
        "median": ("4B(d0 + d2) + 12B·d1/R + 4(P − d2) + 4B·d2", coordinates),
        "trimmed_mean": ("4B(d0 + d2) + 12B·d1/R + 4(P − d2) + 4B·d2", coordinates),
        # every example's A and D rows (and bias gradients), then the result all-gathered
        "bucketing": ("4B·Σ(d_in+2d_out) + 4P", 4 * b * rows_bias + 4 * p),
    }
    return table[rule]


# --------------------------------------------------------------------------------------
# counting collectives


def _shape_bytes(text: str) -> int:
    """Bytes of an HLO result type: ``f32[32,5]{1,0}`` or a tuple of such."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        if dtype not in DTYPE_BYTES:
            continue
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * DTYPE_BYTES[dtype]
    return total


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s+(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$"
)
_CALLEE = re.compile(
    r"\b(to_apply|calls|body|condition|branch_computations|true_computation|"
    r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)


def hlo_collectives(text: str) -> dict:
    """The collectives of a compiled HLO module's text, executions counted.

    Returns:
        ``{"counts": {kind: n}, "bytes": {kind: bytes}, "loop": bool}``: per
        kind, how many collectives run in one execution of the module and the
        bytes of their results; ``loop`` is true if one sits in a ``while``
        loop whose trip count XLA does not state (counted once).
    """
    computations: dict[str, list] = {}
    entry, current = None, None
    for line in text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            current = match.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        match = _INSTRUCTION.match(line)
        if match and current is not None:
            computations[current].append((match.group("type"), match.group("op"),
                                          match.group("rest")))
    # How many times each computation runs per execution of the entry one: the sum
    # over its call sites of the caller's runs times the site's (a while body's trip count).
    callers: dict[str, list] = {}
    for name, instructions in computations.items():
        for _, op, rest in instructions:
            for attribute, callees in _CALLEE.findall(rest):
                times, unknown = 1, False
                if op == "while" and attribute == "body":
                    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                    times, unknown = (int(trip.group(1)), False) if trip else (1, True)
                for callee in filter(None, re.split(r"[{},%\s]+", callees)):
                    callers.setdefault(callee, []).append((name, times, unknown))
    memo: dict[str, tuple[int, bool]] = {entry: (1, False)}

    def runs(name):  # (executions, inside a loop of unknown trip count); the graph is acyclic
        if name not in memo:
            total, unknown = 0, False
            for caller, times, loop in callers.get(name, []):
                caller_runs, caller_unknown = runs(caller)
                total += caller_runs * times
                unknown = unknown or (caller_runs > 0 and (loop or caller_unknown))
            memo[name] = (total, unknown)
        return memo[name]

    counts, sizes, loop = {}, {}, False
    for name, instructions in computations.items():
        for result, op, _ in instructions:
            kind = op[: -len("-done")] if op.endswith("-done") else op
            if kind not in KINDS:
                continue  # the async "-start" halves are counted by their "-done"
            times, unknown = runs(name)
            counts[kind] = counts.get(kind, 0) + times
            sizes[kind] = sizes.get(kind, 0) + times * _shape_bytes(result)
            loop = loop or (times > 0 and unknown)
    return {"counts": counts, "bytes": sizes, "loop": bool(loop)}


TF_KINDS = {
    "CollectiveReduceV2": "all-reduce", "CollectiveReduce": "all-reduce",
    "NcclAllReduce": "all-reduce", "CollectiveGatherV2": "all-gather",
    "CollectiveGather": "all-gather", "CollectiveAllToAllV2": "all-to-all",
    "CollectiveAllToAllV3": "all-to-all", "CollectiveReduceScatterV2": "reduce-scatter",
    "CollectiveBcastSendV2": "broadcast", "CollectiveBcastSend": "broadcast",
}


def tf_collectives(graph) -> dict:
    """The collective ops of a traced TF graph and the functions it calls, on replica 0.

    A static count, to check that :class:`TFCounter` saw every collective op:
    their sizes are not read here (an all-gather of a tensor whose shards may be
    uneven has dimensions unknown at trace time).

    Returns:
        ``{"ops": {kind: n}, "loop": bool, "devices": n}``: the ops per kind on
        replica 0's device, whether one sits in a ``while`` body, and on how
        many devices collectives were placed.
    """
    functions = {}

    def collect(g):
        for name, function in getattr(g, "_functions", {}).items():
            if name not in functions and getattr(function, "graph", None) is not None:
                functions[name] = function.graph
                collect(function.graph)

    collect(graph)
    start = next((g for n, g in functions.items() if "one_step_on_data" in n), graph)
    counts = {}
    flags = {"loop": False, "devices": set()}

    def walk(g, device, in_loop, depth):
        for op in g.get_operations():
            here = op.device or device
            kind = TF_KINDS.get(op.type)
            if kind is not None:
                flags["devices"].add(here)
                if _replica_zero(here):
                    counts[kind] = counts.get(kind, 0) + 1
                    flags["loop"] = flags["loop"] or in_loop
            for attribute, value in op.node_def.attr.items():
                names = [value.func.name] if value.func.name else [f.name for f in value.list.func]
                for name in names:
                    if name in functions and depth < 50:
                        loop = in_loop or (op.type in ("While", "StatelessWhile")
                                           and attribute == "body")
                        walk(functions[name], here, loop, depth + 1)

    walk(start, "", False, 0)
    return {"ops": counts, "loop": flags["loop"], "devices": len(flags["devices"])}


def _replica_zero(device: str) -> bool:
    """Whether a TF device string names replica 0's device (the first CPU), or none."""
    return not device or device.endswith("CPU:0")


#: the functions of ``tensorflow.python.ops.collective_ops`` that return a collective's result
TF_LAUNCHERS = {
    "all_reduce": "all-reduce", "all_reduce_v2": "all-reduce", "all_reduce_v3": "all-reduce",
    "all_gather": "all-gather", "all_gather_v2": "all-gather", "all_to_all_v2": "all-to-all",
    "all_to_all_v3": "all-to-all",
}


class TFCounter:
    """The sizes of the tensors TF's collectives produce on replica 0, read at run time.

    ``tf.distribute``'s cross-device code (``cross_device_utils``'
    ``CollectiveReplicaLauncher``: Keras's gradient all-reduce, a replica
    context's ``all_reduce`` and ``all_gather``) builds its collective ops by
    calling ``tensorflow.python.ops.collective_ops``; :meth:`install` wraps those
    functions so that, while :attr:`tracing` is true, each collective traced on
    replica 0's device is followed by a host callback (``tf.numpy_function``,
    a control dependency of the result) that records the number of elements of
    the op's actual output each time it runs. An all-gather of shards that may
    be uneven is two collectives in TF (the shards' shapes, then the shards
    padded to the largest): both are counted with the sizes they really have.
    """

    def __init__(self):
        self.tracing = False
        self.traced: list[str] = []  # the kinds of the ops wrapped while tracing
        self.runs: list[tuple[str, int]] = []  # (kind, bytes) per execution

    def install(self) -> None:
        from tensorflow.python.ops import collective_ops

        for name, kind in TF_LAUNCHERS.items():
            if hasattr(collective_ops, name):
                setattr(collective_ops, name, self._wrap(getattr(collective_ops, name), kind))

    def _wrap(self, launch, kind):
        import numpy as np
        import tensorflow as tf

        def launched(*args, **kwargs):
            result = launch(*args, **kwargs)
            if not self.tracing or not isinstance(result, tf.Tensor) \
                    or not _replica_zero(result.device):
                return result
            self.traced.append(kind)
            item = result.dtype.size

            def record(size):
                self.runs.append((kind, int(size) * item))
                return np.int64(0)

            token = tf.numpy_function(record, [tf.size(result, out_type=tf.int64)], tf.int64,
                                      stateful=True)
            with tf.control_dependencies([token]):
                return tf.identity(result)

        return launched

    def summary(self) -> dict:
        """``{"counts": {kind: executions}, "bytes": {kind: bytes}}`` of the recorded runs."""
        counts, sizes = {}, {}
        for kind, size in self.runs:
            counts[kind] = counts.get(kind, 0) + 1
            sizes[kind] = sizes.get(kind, 0) + size
        return {"counts": counts, "bytes": sizes}


# --------------------------------------------------------------------------------------
# the child: one backend, R devices


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, LAYERS[0][0])).astype("float32")
    y = rng.integers(0, LAYERS[-1][1], size=(BATCH,)).astype("int32")
    return x, y


def _rule(name: str):
    """The aggregator ``RULE_SOURCE[name]`` describes."""
    from pergrad import aggregators, privacy

    return {
        "mean": lambda: aggregators.mean(),
        "clip": lambda: aggregators.clip(1.0),
        "automatic_clip": lambda: aggregators.automatic_clip(),
        "dp_gaussian": lambda: privacy.dp_gaussian(1.0, 1.0, seed=0),
        "norm_filter": lambda: aggregators.norm_filter(3.0),
        "centered_clip": lambda: aggregators.centered_clip(1.0),
        "krum": lambda: aggregators.krum(0.25),
        "geometric_median": lambda: aggregators.geometric_median(),
        "median": lambda: aggregators.median(),
        "trimmed_mean": lambda: aggregators.trimmed_mean(0.25),
        "bucketing": lambda: aggregators.bucketing(2, aggregators.median(), seed=0),
    }[name]()


def _build(rule: str):
    import keras

    import pergrad

    keras.utils.set_random_seed(0)
    layers = [keras.Input((LAYERS[0][0],))]
    layers += [keras.layers.Dense(o, "tanh" if k < len(LAYERS) - 1 else None)
               for k, (_, o) in enumerate(LAYERS)]
    model = pergrad.PerExampleModel(keras.Sequential(layers), _rule(rule))
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _path(model) -> str:
    from pergrad.engine import chunked
    from pergrad.training import step

    path = step.engine_path(model.aggregator, model.engine_path, model.microbatch_size)
    if path == step.STATISTICS_PATH and not chunked.supports(model.aggregator):
        return "streaming"
    return path


def jax_step(model, x, y, steps: int, untimed: int = 2) -> dict:
    """The collectives of ``model``'s compiled train step on the batch ``(x, y)`` (this
    process's part of it on several processes) and the median time of ``steps`` steps after
    ``untimed`` ones: Keras's jitted step called directly, the state and the batch placed as
    ``fit()`` places them. ``model`` has trained on a batch (built and compiled)."""
    import jax
    from keras.src.backend.jax.trainer import _distribute_data

    model.make_train_function()
    # Keras wraps its jitted train step in a function of (state, iterator).
    jitted = next(c.cell_contents for c in model.train_function.__closure__
                  if hasattr(c.cell_contents, "lower"))
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    data = _distribute_data((x, y, None))
    found = hlo_collectives(jitted.lower(state, data).compile().as_text())
    times = []
    for _ in range(steps + untimed):
        start = time.perf_counter()
        _, state = jitted(state, data)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    found["step_ms"] = 1e3 * statistics.median(times[untimed:])
    return found


def _jax_rule(rule: str, replicas: int, steps: int) -> dict:
    import jax
    import keras

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:replicas]))
    try:
        model = _build(rule)
        x, y = _data()
        model.train_on_batch(x, y)  # builds and compiles, as fit() does
        found = jax_step(model, x, y, steps)
        found["path"] = _path(model)
        return found
    finally:
        keras.distribution.set_distribution(None)


def _tf_rule(rule: str, replicas: int, steps: int, strategy, counter: TFCounter) -> dict:
    import tensorflow as tf

    x, y = _data()
    with strategy.scope():
        model = _build(rule)
    path = _path(model)
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    except ValueError as error:
        return {"refused": str(error).split(". ")[0], "path": path}  # its first sentence
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def step():
        logs = model.train_function(iterator)
        [t.numpy() for t in tf.nest.flatten(logs)]

    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    # Traced again with the counter's callbacks (not in the timed steps); one step.
    counter.tracing, counter.traced, counter.runs = True, [], []
    try:
        model.make_train_function(force=True)
        step()
    finally:
        counter.tracing = False
    found = counter.summary()
    function = next(c.cell_contents for c in model.train_function.__closure__
                    if hasattr(c.cell_contents, "_list_all_concrete_functions"))
    graph = function._list_all_concrete_functions()[-1].graph
    static = tf_collectives(graph)
    traced = {kind: counter.traced.count(kind) for kind in set(counter.traced)}
    if static["ops"] != traced:  # an op the counter did not wrap: its bytes would be missing
        raise RuntimeError(f"collective ops in the graph {static['ops']}, counted {traced}")
    found["ops"], found["loop"] = static["ops"], False  # loops: every execution counted
    found["step_ms"] = 1e3 * statistics.median(times[2:])
    found["path"] = path
    return found


def child(replicas: int, rules: list[str], steps: int) -> None:
    """Runs in a fresh process whose device count is already set; one JSON line per rule."""
    import keras

    backend = keras.backend.backend()
    strategy = counter = None
    if backend == "jax":
        import jax

        assert len(jax.devices()) >= replicas, jax.devices()
    elif backend == "tensorflow":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)])
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][:replicas]
        strategy = tf.distribute.MirroredStrategy(devices)
        counter = TFCounter()
        counter.install()
    for rule in rules:
        try:
            if backend == "jax":
                found = _jax_rule(rule, replicas, steps)
            else:
                found = _tf_rule(rule, replicas, steps, strategy, counter)
        except Exception as error:  # a row that says why, not a lost table
            found = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        found["rule"] = rule
        print("ROW " + json.dumps(found), flush=True)


# --------------------------------------------------------------------------------------
# the driver


def run(backend: str, replicas: int, rules: list[str], steps: int, timeout: float) -> list[dict]:
    """One fresh process with ``replicas`` logical CPU devices; its rows."""
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + f" --xla_force_host_platform_device_count={replicas}").strip()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SOURCE, env.get("PYTHONPATH")]))
    command = [sys.executable, os.path.abspath(__file__), "--child", str(replicas),
               "--rules", ",".join(rules), "--steps", str(steps)]
    completed = subprocess.run(command, env=env, capture_output=True, text=True,
                               timeout=timeout)
    rows = [json.loads(line[4:]) for line in completed.stdout.splitlines()
            if line.startswith("ROW ")]
    if completed.returncode != 0 or len(rows) < len(rules):
        done = {row["rule"] for row in rows}
        message = completed.stderr.strip().splitlines()[-1:] or ["no output"]
        rows += [{"rule": r, "error": f"process exited {completed.returncode}: {message[0]}"}
                 for r in rules if r not in done]
    return rows


def describe(row: dict) -> str:
    if not row.get("counts"):
        return "none"
    text = ", ".join(f"{n} {kind}" for kind, n in sorted(row["counts"].items()))
    return text + (" (loop?)" if row.get("loop") else "")


def table(backend: str, results: dict[int, list[dict]]) -> str:
    lines = ["| R | rule | path | collectives | bytes/step/device | formula | formula bytes "
             "| step ms |", "|---:|---|---|---|---:|---|---:|---:|"]
    for replicas, rows in results.items():
        for row in rows:
            rule = row["rule"]
            text, value = formula(rule, replicas, backend)
            if "refused" in row or "error" in row:
                why = f"refused: {row['refused']}" if "refused" in row else row["error"]
                lines.append(f"| {replicas} | {rule} | {row.get('path', '')} | {why} | | "
                             f"`{text}` | {value:,} | |")
                continue
            total = sum(row["bytes"].values())
            lines.append(
                f"| {replicas} | {rule} | {row['path']} | {describe(row)} | {total:,}"
                f" | `{text}` | {value:,} "
                f"| {row['step_ms']:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="2,4",
                        help="comma list of logical CPU device counts (default %(default)s)")
    parser.add_argument("--rules", default=",".join(RULES),
                        help="comma list from " + ",".join(RULES))
    parser.add_argument("--backends", default=None,
                        help="comma list of jax, tensorflow (default: KERAS_BACKEND if set, "
                        "else both)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per rule")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)  # bench.py passes its own options through
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    for rule in rules:
        if rule not in RULE_SOURCE:
            parser.error(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")
    if args.child is not None:
        child(args.child, rules, args.steps)
        return 0
    backends = (args.backends or os.environ.get("KERAS_BACKEND") or "jax,tensorflow").split(",")
    for backend in backends:
        if backend not in ("jax", "tensorflow"):
            parser.error(f"--replicas measures JAX and TensorFlow, not {backend!r} (Keras's "
                         "torch backend does not distribute fit())")
    counts = [int(r) for r in str(args.replicas).split(",")]
    everything = {}
    for backend in backends:
        results = everything[backend] = {}
        for replicas in counts:
            print(f"{backend}: {replicas} logical CPU devices ...", file=sys.stderr, flush=True)
            results[replicas] = run(backend, replicas, rules, args.steps, args.timeout)
        report(backend, results, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


def report(backend: str, results: dict, steps: int) -> None:
    """Prints one backend's table."""
    engine = ("keras.distribution.DataParallel; bytes from the compiled HLO's collectives"
              if backend == "jax" else
              "tf.distribute.MirroredStrategy; bytes of the collectives' outputs at run time")
    print(f"## Communication per step: {backend}, {engine}\n")
    print(f"MLP {LAYERS[0][0]}-{LAYERS[0][1]}-{LAYERS[1][1]} (P = "
          f"{sum(i * o + o for i, o in LAYERS)}), global batch B = {BATCH}, float32; bytes = "
          "result sizes of one step's collectives on one device. Formula: the leading terms "
          "(Σ over the Dense layers; T = geometric_median's iterations; V = "
          f"{2 * len(LAYERS)} variables; d0, d1, d2 = the MLP's widths)"
          + ("; each all-gather first gathers the shards' shapes (R x rank int32), then "
             "the shards padded to the largest (two collectives)" if backend == "tensorflow"
             else "")
          + f". Step times: median of {steps} steps on R logical devices sharing "
          f"{os.cpu_count()} CPU cores: NOT a speed measurement.\n")
    if backend == "jax":
        print("The per-device program is the same on every device: a collective-permute's "
              "result arrives only at its targets (device 0 here), the other devices "
              "receive less.\n")
    print(table(backend, results) + "\n", flush=True)


if __name__ == "__main__":
    sys.exit(main())
