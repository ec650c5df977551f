"""Several devices: single-device results, or a clear refusal (docs/architecture.md,
'Multi-device training').

Each test runs a small script in a fresh Python process, because the device count
is fixed before the backend is imported (``--xla_force_host_platform_device_count``
for JAX, logical CPU devices for TensorFlow) and torch needs a process per rank.
Each runs once, in the pytest session of its backend (the others skip it, saying
so): a fresh JAX process costs its start-up and a compile per rule.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from conftest import BACKEND

TESTS = pathlib.Path(__file__).resolve().parent
SOURCE = TESTS.parent / "src"


def _run_all(script: str, backend: str, runs: list, timeout: int = 600, env: dict | None = None):
    """Runs ``script`` once per argument list in ``runs``, the processes at once (the
    ranks of a process group); returns the JSON of each one's last output line."""
    environment = dict(os.environ, KERAS_BACKEND=backend, **(env or {}))
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(SOURCE), str(TESTS), os.environ.get("PYTHONPATH")])
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", script, *args], env=environment,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in runs
    ]
    reports = []
    for process in processes:
        out, err = process.communicate(timeout=timeout)
        assert process.returncode == 0, err[-4000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def _run(script: str, backend: str, *args: str, env: dict | None = None, timeout: int = 600):
    """Runs ``script`` in a fresh process; returns the JSON of its last output line."""
    return _run_all(script, backend, [args], timeout, env)[0]


def _only(backend: str):
    return pytest.mark.skipif(
        BACKEND != backend,
        reason=f"runs its own {backend} process once, in the KERAS_BACKEND={backend} session",
    )


def _assert_as_one_device(report, moved):
    """Every rule moved the weights by more than ``moved``, the DP noise (on) by more than
    1e-3, and every run on several devices ended within 1e-5 of one device's."""
    assert min(report["moved"].values()) > moved, report["moved"]
    assert report["noise"] > 1e-3, report["noise"]  # the noise is on
    bad = {key: d for key, d in report["differences"].items() if not d <= 1e-5}
    assert not bad, bad


_JAX_DATA_PARALLEL = """
import json
import jax, keras, numpy as np
import pergrad, problems
from pergrad import aggregators, privacy

RULES = {
    "mean": lambda: "mean",
    "clip": lambda: aggregators.clip(0.5),
    "median": lambda: "median",  # the streaming path
    "trimmed_mean": lambda: aggregators.trimmed_mean(0.25),
    "krum": lambda: aggregators.krum(0.25),
    "bucketing": lambda: aggregators.bucketing(2, aggregators.median(), seed=3),
    "dp_noise_0": lambda: privacy.dp_gaussian(0.5, 0.0, seed=5),
    "dp_noise_1": lambda: privacy.dp_gaussian(0.5, 1.0, seed=5),
    # One global program: its groups are the batch's, whatever the devices (2 = groups, 4 != groups).
    "two_level": lambda: aggregators.two_level(2, across=aggregators.clip(0.5)),
}
MODEL_PARALLEL = ("median", "krum", "dp_noise_1")

def model_parallel():
    # Megatron-style: the hidden layer's columns and the output layer's rows over "model".
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=jax.devices())
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*hidden/kernel"] = (None, "model")
    layouts[".*hidden/bias"] = ("model",)
    layouts[".*out/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")

def train(rule, replicas):
    distribution = None
    if replicas == "2x2":
        distribution = model_parallel()
    elif replicas is not None:
        distribution = keras.distribution.DataParallel(devices=jax.devices()[:replicas])
    keras.distribution.set_distribution(distribution)
    try:
        problem = problems.dense_mlp(batch=16)  # its data and loss; layers named for layouts
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, "tanh", name="hidden"),
                                keras.layers.Dense(3, name="out")])
        model = pergrad.PerExampleModel(net, RULES[rule]())
        model.compile(optimizer="sgd", loss=problem.loss)
        initial = net.get_weights()
        model.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=8,
                  epochs=2, shuffle=False, verbose=0)
        kernel = net.trainable_variables[0].value
        spec = str(getattr(kernel.sharding, "spec", None))
        return net.get_weights(), initial, spec, len(kernel.sharding.device_set)
    finally:
        keras.distribution.set_distribution(None)

def difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))

report = {"devices": len(jax.devices()), "differences": {}, "placed_on": {}}
single = {}
for rule in RULES:
    single[rule], initial, _, _ = train(rule, None)
    report.setdefault("moved", {})[rule] = difference(single[rule], initial)
    # 2x2: ModelParallel, the kernels sharded over "model", the batch over "batch".
    for replicas in (1, 2, 4) + (("2x2",) if rule in MODEL_PARALLEL else ()):
        weights, _, spec, placed = train(rule, replicas)
        report["differences"][f"{rule}/{replicas}"] = difference(weights, single[rule])
        report["placed_on"][f"{rule}/{replicas}"] = [spec, placed]
report["noise"] = difference(single["dp_noise_1"], single["dp_noise_0"])
print(json.dumps(report))
"""


@_only("jax")
def test_jax_data_parallel_trains_as_one_device():
    # XLA's SPMD partitioner keeps the global semantics of the step: the median's
    # and Krum's gathers, one DP noise drawn from the shared seed; also with the
    # kernels sharded (ModelParallel on a 2 x 2 mesh) for three rule kinds.
    report = _run(
        _JAX_DATA_PARALLEL, "jax",
        # CPU devices even where an accelerator is present: four of them.
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"},
    )
    assert report["devices"] == 4
    for key, (spec, placed) in report["placed_on"].items():  # the distribution was in effect
        sharded = key.endswith("/2x2")
        assert placed == (4 if sharded else int(key.split("/")[1])), (key, placed)
        assert ("'model'" in spec) == sharded, (key, spec)
    # The noise is on (it moves the weights 100x the tolerance), the same for every R.
    _assert_as_one_device(report, moved=1e-3)


_TF_MIRRORED = """
import contextlib, json
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
import keras, pergrad, problems
from pergrad import aggregators, privacy

RULES = {
    "mean": lambda: "mean",
    "sum": lambda: "sum",  # with an L2 regularizer: its gradient added once
    "clip": lambda: aggregators.clip(0.5),
    "clip_per_layer": lambda: aggregators.clip(0.5, per_layer=True),
    "automatic_clip": lambda: aggregators.automatic_clip(),
    # Clipping steps before mean: the chain's shares are local, as its rule's.
    "clip_mean": lambda: aggregators.chain(aggregators.clip(0.5), aggregators.mean()),
    "dp_noise_0": lambda: privacy.dp_gaussian(0.5, 0.0, seed=5, diagnostics=True),
    "dp_noise_1": lambda: privacy.dp_gaussian(0.5, 1.0, seed=5),
    # Divides by a constant, not the batch size; the materialized path.
    "dp_expected": lambda: privacy.dp_gaussian(0.5, 1.0, seed=5, expected_batch_size=7.0),
    # Its clipping norm from the count over every replica's shard, noised once.
    "adaptive": lambda: privacy.adaptive_dp_gaussian(0.3, 1.0, seed=5, expected_batch_size=7.0,
                                                     count_stddev=1.0),
    # The whole batch's statistics (gathered norms), Gram matrix (gathered A, D rows).
    "norm_filter": lambda: aggregators.norm_filter(drop_fraction=0.25),
    "krum": lambda: aggregators.krum(0.25),
    "geometric_median": lambda: aggregators.geometric_median(),
    # The streaming path on gathered A, D rows, each replica aggregating its parts.
    "median": lambda: "median",
    "trimmed_mean": lambda: aggregators.trimmed_mean(0.25),
    "sign_majority": lambda: aggregators.sign_majority(),
    "bucketing": lambda: aggregators.bucketing(2, aggregators.median(), seed=3),
    "clip_median": lambda: aggregators.chain(aggregators.clip(0.5), aggregators.median()),
    # The materialized path on gathered per-example gradients: state kept identical.
    "centered_clip": lambda: aggregators.centered_clip(1.0),
    "function": lambda: (lambda grads: [g[0] + g[-1] for g in grads]),
}
EXACT = tuple(RULES)
FOUR = ("clip", "dp_noise_1", "krum", "median", "bucketing", "centered_clip", "function")

def build(rule, strategy, make=None, **options):
    with strategy.scope() if strategy else contextlib.nullcontext():
        problem = make() if make else problems.dense_mlp(batch=16, l2=0.05 if rule == "sum" else None)
        path = "materialized" if rule == "dp_expected" else "auto"
        model = pergrad.PerExampleModel(problem.model, RULES[rule](), path=path, **options)
        model.compile(optimizer="sgd", loss=problem.loss)
    return problem, model

def train(rule, strategy, make=None, **options):
    problem, model = build(rule, strategy, make, **options)
    # 13 examples in batches of 8: the second batch's shards uneven (3 + 2; 2 + 2 + 1 + 0,
    # one empty). (Keras's fit() itself fails when the first batch's shards are uneven.)
    history = model.fit(problem.x[:13], problem.y[:13], sample_weight=problem.sample_weight[:13],
                        batch_size=8, epochs=2, shuffle=False, verbose=0)
    spread = max(  # between the replicas' copies of each weight and of the rule's state
        float(np.max(np.abs(parts[0].numpy() - part.numpy())))
        for parts in (getattr(v.value, "values", (v.value,)) for v in model.weights)
        for part in parts
    )
    return problem.model.get_weights(), {k: v[-1] for k, v in history.history.items()}, spread

def difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))

def log_difference(a, b):
    return max(abs(a[k] - b[k]) for k in a) if sorted(a) == sorted(b) else float("inf")

report = {"single": {}, "several": {}, "refused": {}, "moved": {}}
alone = {}
for rule in ("mean", "clip", "median"):
    weights, logs, _ = train(rule, None)
    for name, strategy in [("one_device", tf.distribute.OneDeviceStrategy("/cpu:0")),
                           ("mirrored_1", tf.distribute.MirroredStrategy(["/cpu:0"]))]:
        other, other_logs, _ = train(rule, strategy)
        report["single"][f"{rule}/{name}"] = [difference(other, weights), sorted(other_logs) == sorted(logs)]

two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
# Collective ops of another group size in the same process clash (TF): reduce on one device.
four = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)],
                                      cross_device_ops=tf.distribute.ReductionToOneDevice())
for rule in EXACT:
    alone[rule], logs, _ = train(rule, None)
    report["moved"][rule] = difference(alone[rule], build(rule, None)[0].model.get_weights())
    for replicas, strategy in [(2, two)] + ([(4, four)] if rule in FOUR else []):
        weights, other_logs, spread = train(rule, strategy)
        report["several"][f"{rule}/{replicas}"] = [
            difference(weights, alone[rule]), log_difference(other_logs, logs), spread]
report["noise"] = difference(alone["dp_noise_1"], alone["dp_noise_0"])
# Dropout: each example's stream from its position in the global batch.
dropout = lambda: problems.dense_mlp(batch=16, dropout=0.2)
for rule in ("mean", "median"):
    weights, logs, _ = train(rule, None, dropout)
    other, other_logs, spread = train(rule, two, dropout)
    report["several"][f"dropout_{rule}/2"] = [
        difference(other, weights), log_difference(other_logs, logs), spread]

# microbatch_size: the chunked path (clip), the streaming path's blocks (median).
for rule in ("clip", "median"):
    weights, logs, _ = train(rule, None, microbatch_size=3)
    other, other_logs, spread = train(rule, two, microbatch_size=3)
    report["several"][f"microbatch_{rule}/2"] = [
        difference(other, weights), log_difference(other_logs, logs), spread]

refused = [("masked_dense", "median", lambda: problems.masked_dense(batch=16), {}),
           ("microbatch", "krum", None, {"microbatch_size": 4})]  # the chunked path's statistics
for key, rule, make, options in refused:
    problem, model = build(rule, two, make, **options)
    before = problem.model.get_weights()
    calls = {"fit": lambda: model.fit(problem.x, problem.y, batch_size=8, epochs=1, verbose=0)}
    if key == "microbatch":
        calls.update({
            "train_on_batch": lambda: model.train_on_batch(problem.x[:8], problem.y[:8]),
            # A custom loop: train_step in each replica's context.
            "strategy.run": lambda: two.run(
                tf.function(model.train_step), args=((problem.x[:8], problem.y[:8]),)
            ),
        })
    for call, run in calls.items():
        try:
            run()
            message = None
        except ValueError as error:
            message = str(error)
        report["refused"][f"{key}/{call}"] = message
    report["refused"][f"{key}/unchanged"] = difference(problem.model.get_weights(), before)
print(json.dumps(report))
"""


@_only("tensorflow")
def test_tensorflow_mirrored_strategy_exact_rules_and_refusals():
    # Before: clip, automatic clipping and DP raised inside Keras (diagnostics on one
    # replica only), the median took a median per replica; then every rule but mean,
    # sum, clipping and DP-SGD was refused on two replicas. Now every kind of rule
    # (local statistics, gathered statistics and Gram, streamed coordinate rules,
    # stateful and user functions on gathered gradients) trains as one device on 2 and
    # 4 replicas with uneven and empty shards, logs included, and so does a model with
    # Dropout; a masked output and microbatch_size are refused, a single-replica
    # strategy trains as no strategy.
    report = _run(_TF_MIRRORED, "tensorflow")
    for key, (difference, same_logs) in report["single"].items():
        assert difference <= 1e-6 and same_logs, (key, difference, same_logs)
    assert min(report["moved"].values()) > 1e-3, report["moved"]
    assert report["noise"] > 1e-3, report["noise"]  # the noise is on
    assert len(report["several"]) == 31, report["several"]
    for key, (difference, logs, spread) in report["several"].items():
        # Same weights and logs (loss, clipped_fraction, gradient_norm, l2_norm_clip) as one device;
        # the replicas' copies identical (one noise, added once).
        assert difference <= 1e-5 and logs <= 1e-5 and spread == 0.0, (key, difference, logs, spread)
    assert len(report["refused"]) == 6, report["refused"]
    for key, message in report["refused"].items():
        if key.endswith("/unchanged"):
            assert message == 0.0, key  # nothing was updated
            continue
        assert message is not None, f"{key} was not refused"
        if key.startswith("masked_dense"):
            assert "masked output on several replicas" in message, message
            continue
        assert "tf.distribute strategy with 2 replicas" in message, message
        assert "microbatch_size" in message and "keras.distribution.DataParallel" in message, message


_TORCH_RANK = """
import json, sys
import torch.distributed as dist
import pergrad, problems

rank, init = int(sys.argv[1]), sys.argv[2]

def fit():
    problem = problems.dense_mlp()
    model = pergrad.PerExampleModel(problem.model, "median")
    model.compile(optimizer="sgd", loss=problem.loss)
    try:
        model.fit(problem.x, problem.y, epochs=1, verbose=0)
        return None
    except ValueError as error:
        return str(error)

report = {"alone": fit()}
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
try:
    report["group"] = fit()
finally:
    dist.destroy_process_group()
print(json.dumps(report))
"""


@_only("torch")
def test_torch_process_group_refused(tmp_path):
    # Keras's torch fit() never all-reduces gradients: with a process group of two,
    # each rank would silently train its own model on its own data.
    init = (tmp_path / "rendezvous").as_uri()
    for report in _run_all(_TORCH_RANK, "torch", [[str(rank), init] for rank in range(2)], 300):
        assert report["alone"] is None  # no process group: trains
        assert report["group"] is not None, "fit() trained under a process group of two"
        assert "torch.distributed process group" in report["group"], report
        assert "with 2 replicas" in report["group"], report


_TF_POISSON = """
import contextlib, json, warnings
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
import keras, pergrad, problems
from pergrad import aggregators, privacy

RATE, DELTA, STEPS = 0.15, 1e-5, 14  # 7 steps per epoch, 2 epochs
RULES = {
    "dp_noise_0": lambda sampler: privacy.dp_gaussian(
        0.5, 0.0, seed=5, expected_batch_size=sampler.expected_batch_size),
    "dp_noise_1": lambda sampler: privacy.dp_gaussian(
        0.5, 1.0, seed=5, expected_batch_size=sampler.expected_batch_size),
    "mean": lambda sampler: "mean",
    "clip": lambda sampler: aggregators.clip(0.5),
}

class Recording(privacy.PoissonSampler):
    def __getitem__(self, index):  # the rows of every batch served
        batch = super().__getitem__(index)
        self.rows.add(len(batch[2]))
        return batch

def train(rule, strategy, max_batch_size=7, steps_per_execution=1, budget=None):
    with strategy.scope() if strategy else contextlib.nullcontext():
        problem = problems.dense_mlp(batch=16)
        # buckets of 2 rows (rounded up to a multiple of the replicas), at most 7 (8) rows
        sampler = Recording(problem.x, problem.y, sampling_rate=RATE, seed=0,
                            sample_weight=problem.sample_weight,
                            max_batch_size=max_batch_size, bucket_width=2)
        sampler.rows = set()
        aggregator = RULES[rule](sampler)
        model = pergrad.PerExampleModel(problem.model, aggregator)
        model.compile(optimizer="sgd", loss=problem.loss, steps_per_execution=steps_per_execution)
    private = rule.startswith("dp")
    callbacks = None
    if rule == "dp_noise_1":
        callbacks = [privacy.PrivacyAccountant(1.0, RATE, DELTA, max_epsilon=budget)]
    before = problem.model.get_weights()
    try:
        history = model.fit(sampler, epochs=2, verbose=0, callbacks=callbacks)
    except ValueError as error:
        return {"refused": str(error), "unchanged": difference(problem.model.get_weights(), before)}
    return {
        "weights": problem.model.get_weights(),
        "logs": history.history,
        "steps": int(keras.ops.convert_to_numpy(aggregator.step_count)) if private else None,
        "batch_size": sampler.batch_size,  # back to max_batch_size after fit
        "rows": sorted(sampler.rows),
        "sizes": [len(sampler.indices_for_step(t)) for t in range(STEPS)],
    }

def difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))

two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
four = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)],
                                      cross_device_ops=tf.distribute.ReductionToOneDevice())
report, alone_weights = {"several": {}, "epsilon": {}, "rows": {}}, {}
for rule in ("dp_noise_0", "dp_noise_1"):
    alone = train(rule, None)
    alone_weights[rule] = alone["weights"]
    report["rows"][f"{rule}/1"] = alone["rows"]
    report["sizes"], report["steps"] = alone["sizes"], alone["steps"]
    report["epsilon"][f"{rule}/1"] = alone["logs"].get("epsilon")
    report[f"moved/{rule}"] = difference(alone["weights"], problems.dense_mlp(batch=16).model.get_weights())
    for replicas, strategy in ((2, two),) + (((4, four),) if rule == "dp_noise_1" else ()):
        run = train(rule, strategy)
        report["several"][f"{rule}/{replicas}"] = [
            difference(run["weights"], alone["weights"]), run["steps"], run["batch_size"]]
        report["rows"][f"{rule}/{replicas}"] = run["rows"]
        report["epsilon"][f"{rule}/{replicas}"] = run["logs"].get("epsilon")
report["noise"] = difference(alone_weights["dp_noise_1"], alone_weights["dp_noise_0"])

# Rules that count the padding: a size that divides trains as one device, another is refused.
alone, run = train("clip", None, 8), train("clip", two, 8)
report["several"]["clip/2"] = [difference(run["weights"], alone["weights"]), None, run["batch_size"]]
report["rows"]["clip/2"] = run["rows"]
report["clip_logs"] = max(abs(alone["logs"][k][-1] - run["logs"][k][-1]) for k in alone["logs"])
report["refused"] = train("mean", two)
# A budget cannot be enforced inside a group of steps on replicas: refused before any step.
report["grouped_budget"] = train("dp_noise_1", two, steps_per_execution=2, budget=10.0)

# Plain batches: the last one (1 example) leaves replica 1 an empty shard.
def plain(strategy):
    with strategy.scope() if strategy else contextlib.nullcontext():
        problem = problems.dense_mlp(batch=17)
        model = pergrad.PerExampleModel(problem.model, privacy.dp_gaussian(0.5, 1.0, seed=5))
        model.compile(optimizer="sgd", loss=problem.loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not Poisson-sampled
        model.fit(problem.x, problem.y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return problem.model.get_weights()
report["empty_shard"] = difference(plain(two), plain(None))
print(json.dumps(report))
"""


@_only("tensorflow")
def test_tensorflow_mirrored_strategy_poisson_sampling():
    # Before: fit() refused a PoissonSampler on several replicas, and a DP step whose
    # batch left a replica an empty shard gave NaN weights (noise / 0 times 0). Now
    # the sampler's one Poisson sample is split over 2 (and 4) replicas, its batches
    # padded to buckets of 2 rows rounded up to a multiple of the replicas, at most 8
    # (dp_gaussian ignores padding): the weights, the step count and epsilon are
    # those of one device, draws of 0 examples included.
    from pergrad import privacy

    report = _run(_TF_POISSON, "tensorflow")
    assert 0 in report["sizes"] and max(report["sizes"]) >= 4, report["sizes"]  # empty, and > R
    assert report["steps"] == 14
    assert report["moved/dp_noise_0"] > 1e-3 and report["noise"] > 1e-3, report
    assert len(report["several"]) == 4, report["several"]
    for key, (difference, steps, batch_size) in report["several"].items():
        assert difference <= 1e-5, (key, difference)
        assert steps == (14 if key.startswith("dp") else None), (key, steps)
        assert batch_size == (8 if key.startswith("clip") else 7), (key, batch_size)
    assert report["clip_logs"] <= 1e-5, report["clip_logs"]
    rows = report["rows"]  # buckets where the rule ignores padding, else max_batch_size rows
    assert len(rows["dp_noise_0/1"]) >= 3 and set(rows["dp_noise_0/1"]) <= {2, 4, 6, 7}, rows
    for replicas in (2, 4):
        seen = rows.get(f"dp_noise_1/{replicas}", [])
        assert len(seen) >= 2 and all(r % replicas == 0 and r <= 8 for r in seen), rows
    assert rows["clip/2"] == [8], rows
    # The accountant counts each step once, at the global rate q.
    expected = [privacy.epsilon(1.0, 0.15, steps, 1e-5) for steps in (7, 14)]
    for key, epsilons in report["epsilon"].items():
        if key.startswith("dp_noise_1"):
            assert epsilons == pytest.approx(expected, rel=1e-9), key
    assert "max_batch_size=8" in report["refused"]["refused"], report["refused"]
    assert report["refused"]["unchanged"] == 0.0
    assert report["empty_shard"] <= 1e-5, report["empty_shard"]
    assert "steps_per_execution=2" in report["grouped_budget"]["refused"], report["grouped_budget"]
    assert report["grouped_budget"]["unchanged"] == 0.0


_MIXED_PRECISION = """
import contextlib, json, os
import numpy as np
BACKEND = os.environ["KERAS_BACKEND"]
if BACKEND == "tensorflow":
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, pergrad, problems
from pergrad import aggregators, privacy

RULES = {
    "plain": None,  # Keras's own fit(): the mean's reference (its float16 backward pass)
    "mean": lambda: "mean",
    "mean_skips": lambda: "mean",  # with an initial loss scale that overflows float16
    "clip": lambda: aggregators.clip(0.5),
    "dp_noise_0": lambda: privacy.dp_gaussian(0.5, 0.0, seed=5),
    "dp_noise_1": lambda: privacy.dp_gaussian(0.5, 1.0, seed=5),
}
if BACKEND == "jax":
    import jax
    RULES.update(median=lambda: "median", krum=lambda: aggregators.krum(0.25))
    two = keras.distribution.DataParallel(devices=jax.devices()[:2])
    def on(devices):
        keras.distribution.set_distribution(two if devices == 2 else None)
        return contextlib.nullcontext()
else:
    two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    def on(devices):
        return two.scope() if devices == 2 else contextlib.nullcontext()

def optimizer(rule, policy):
    sgd = keras.optimizers.SGD(0.5)
    if policy == "mixed_float16" and rule not in ("plain", "mean"):
        # 2**18 overflows float16 in the backward pass: steps skipped, the scale halved.
        return keras.optimizers.LossScaleOptimizer(sgd, initial_scale=2.0**18)
    return sgd  # compile() wraps it in a LossScaleOptimizer for mixed_float16 (scale 2**15)

def train(rule, devices, policy):
    keras.config.set_dtype_policy(policy)
    try:
        with on(devices):
            problem = problems.dense_mlp(batch=16)
            start = problem.model.get_weights()
            model = problem.model
            if rule != "plain":
                model = pergrad.PerExampleModel(problem.model, RULES[rule]())
            model.compile(optimizer=optimizer(rule, policy), loss=problem.loss)
        with on(devices):
            model.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=8,
                      epochs=2, shuffle=False, verbose=0)
        weights = [np.asarray(w, np.float64) for w in problem.model.get_weights()]
        scaler = model.optimizer
        steps = [int(keras.ops.convert_to_numpy(scaler.iterations))]
        if isinstance(scaler, keras.optimizers.LossScaleOptimizer):
            steps.append(float(keras.ops.convert_to_numpy(scaler.dynamic_scale)))
        kind = [problem.model.layers[0].compute_dtype, type(scaler).__name__]
        return weights, difference(weights, start), steps, kind
    finally:
        keras.config.set_dtype_policy("float32")
        if BACKEND == "jax":
            keras.distribution.set_distribution(None)

def difference(a, b):
    return max(float(np.max(np.abs(np.asarray(u, np.float64) - v))) for u, v in zip(a, b))

single32 = {rule: train(rule, 1, "float32")[0] for rule in RULES if rule not in ("plain", "mean_skips")}
report = {}
for policy in ("mixed_float16", "mixed_bfloat16"):
    runs = {}
    for rule in RULES:
        if rule == "mean_skips" and policy != "mixed_float16":
            continue
        one, moved, steps_one, kind = train(rule, 1, policy)
        several, _, steps_two, _ = train(rule, 2, policy)
        runs[rule] = one, several
        report[f"{policy}/{rule}"] = {
            "difference": difference(several, one), "moved": moved, "kind": kind,
            "steps": [steps_one, steps_two],
            "float32": difference(single32[rule], one) if rule in single32 else None,
        }
    report[f"{policy}/mean_vs_plain"] = [difference(runs["mean"][k], runs["plain"][k]) for k in (0, 1)]
print(json.dumps(report))
"""


def _check_mixed_precision(report):
    # Thresholds from measurements (docs/architecture.md, 'Multi-device training'):
    # statistics in float32 give the one-device weights to <= 6e-8 on two devices,
    # while the one-device float32 run is >= 2e-4 away (float16 activations).
    # The mean is Keras's own batch gradient, its backward pass in float16: pergrad's
    # equals plain fit() on the same devices, and two devices differ from one by
    # Keras's own float16 rounding (about one epsilon of the compute dtype, relative
    # to how far the weights moved: 3e-4 and 4.5e-3 of it).
    epsilon = {"mixed_float16": 2.0**-11, "mixed_bfloat16": 2.0**-8}
    skipped = []
    for key, run in report.items():
        policy, rule = key.split("/")
        if rule == "mean_vs_plain":
            assert max(run) <= 1e-6, (key, run)
            continue
        assert run["kind"][0] == policy.split("_")[1], (key, run["kind"])
        if policy == "mixed_float16":
            assert run["kind"][1] == "LossScaleOptimizer", (key, run["kind"])
        assert run["moved"] > 1e-2, (key, run["moved"])
        if run["steps"][0][0] < 4 and run["steps"][1][0] < 4:
            skipped.append(key)
        if rule == "mean_skips":
            # Keras's float16 backward pass sums the batch: a replica's sum of B / R
            # examples overflows less often than one device's of B, so the skipped
            # steps may differ (they do on TensorFlow), but an overflowing step is never
            # applied (the weights would be NaN).
            assert run["difference"] < 1.0, (key, run["difference"])
            continue
        # The same loss scale and skipped steps (float16 overflows) on two devices.
        assert run["steps"][0] == run["steps"][1], (key, run["steps"])
        if rule in ("plain", "mean"):
            bound = 4 * epsilon[policy] * run["moved"]
            assert run["difference"] <= bound, (key, run["difference"], bound)
        else:
            assert run["difference"] <= 1e-6, (key, run["difference"])
        if run["float32"] is not None:  # the tolerance is finer than float16's effect
            assert run["float32"] > 1e-5, (key, run["float32"])
    # Steps were skipped (from the initial scale 2**18) and others applied.
    assert {"mixed_float16/mean_skips", "mixed_float16/clip"} <= set(skipped), skipped


@_only("tensorflow")
def test_tensorflow_mirrored_strategy_mixed_precision():
    # mixed_float16 (a LossScaleOptimizer) and mixed_bfloat16 on two replicas train
    # as on one device: mean, clip, DP-SGD (noise 0 and on).
    _check_mixed_precision(_run(_MIXED_PRECISION, "tensorflow"))


@_only("jax")
def test_jax_data_parallel_mixed_precision():
    # As on TensorFlow, with the median (streaming path) and Krum (Gram matrix) too.
    _check_mixed_precision(_run(
        _MIXED_PRECISION, "jax",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"},
    ))


_TF_MULTI_WORKER = """
import contextlib, hashlib, json, os, sys, time
index, ports = int(sys.argv[1]), json.loads(sys.argv[2])
os.environ["TF_CONFIG"] = json.dumps({
    "cluster": {"worker": [f"localhost:{port}" for port in ports]},
    "task": {"type": "worker", "index": index},
})
import numpy as np, tensorflow as tf
ring = tf.distribute.experimental.CommunicationImplementation.RING
strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(implementation=ring))
import keras, pergrad, problems
from pergrad import aggregators, privacy

RULES = {
    "mean": lambda: "mean",
    "clip": lambda: aggregators.clip(0.5),
    "dp_noise_1": lambda: privacy.dp_gaussian(0.5, 1.0, seed=5),
    # A secret key: each worker draws its own, the noise is added on replica 0 only.
    "dp_secret": lambda: privacy.dp_gaussian(0.5, 1.0),
    # Its count is noised on every replica: refused with each worker's own key.
    "adaptive_secret": lambda: privacy.adaptive_dp_gaussian(0.3, 1.0, expected_batch_size=4.0,
                                                            count_stddev=1.0),
}
COMPARED = ("mean", "clip", "dp_noise_1")

def build(rule, strategy=None):
    with strategy.scope() if strategy else contextlib.nullcontext():
        problem = problems.dense_mlp(batch=16)
        model = pergrad.PerExampleModel(problem.model, RULES[rule]())
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=problem.loss)
    return problem, model

def train(rule):
    # A custom loop: Keras 3.15's fit() fails under MultiWorkerMirroredStrategy with
    # several workers, plain models too (docs/architecture.md, 'Multi-device training').
    problem, model = build(rule, strategy)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    # Every worker holds the whole data set; each global batch of 8 is split over the
    # workers (DATA auto-sharding, as Keras's array adapter asks for).
    data = tf.data.Dataset.from_tensor_slices((problem.x, problem.y, problem.sample_weight))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    shards = strategy.experimental_distribute_dataset(data.batch(8).with_options(options))
    step = tf.function(lambda batch: strategy.run(model.train_step, args=(batch,)))
    sizes = []
    for _ in range(2):
        for batch in shards:
            sizes += [int(t.shape[0]) for t in strategy.experimental_local_results(batch[0])]
            step(batch)
    return problem.model.get_weights(), pergrad.distributed.replicas.count(model), sizes

def alone(rule):
    problem, model = build(rule)
    model.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=8, epochs=2,
              shuffle=False, verbose=0)
    return problem.model.get_weights()

def difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))

start = time.time()
report = {"replicas": strategy.num_replicas_in_sync, "differences": {}, "counts": {}, "sizes": {},
          "digests": {}, "moved": {}}
single = {}
for rule in COMPARED:
    weights, report["counts"][rule], report["sizes"][rule] = train(rule)
    single[rule] = alone(rule)
    report["differences"][rule] = difference(weights, single[rule])
    report["moved"][rule] = difference(single[rule], build(rule)[0].model.get_weights())
    report["digests"][rule] = hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()
report["noise"] = difference(single["dp_noise_1"], single["clip"])
weights, _, _ = train("dp_secret")
report["digests"]["dp_secret"] = hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()
report["refused"] = {}
try:
    train("adaptive_secret")
except ValueError as error:
    report["refused"]["adaptive_secret"] = str(error)
problem = problems.dense_mlp(batch=16)
try:
    privacy.PoissonSampler(problem.x, problem.y, sampling_rate=0.25)
except ValueError as error:
    report["refused"]["sampler"] = str(error)
report["seconds"] = time.time() - start
print(json.dumps(report))
"""


@_only("tensorflow")
def test_tensorflow_multi_worker_mirrored_strategy():
    # Two worker processes on localhost, one CPU replica each, RING collectives: mean,
    # clip and DP-SGD (noise on) train as one device on the whole batch, pergrad counts
    # the replicas of both workers, and the workers' weights are identical, with a secret
    # DP key too. Adaptive clipping with a secret key (each worker's own) and the Poisson
    # sampler (each worker's own draws) are refused.
    sockets = [socket.socket() for _ in range(2)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = json.dumps([s.getsockname()[1] for s in sockets])
    for s in sockets:
        s.close()
    reports = _run_all(_TF_MULTI_WORKER, "tensorflow", [[str(index), ports] for index in range(2)], 400)
    # One model: same noise, same update; with secret keys too (the noise is replica 0's).
    assert reports[0]["digests"] == reports[1]["digests"] and "dp_secret" in reports[0]["digests"]
    for report in reports:
        # What each worker's own key or draws would break is refused, before any step.
        refused = report["refused"]
        assert "AdaptiveDPGaussian with a secret key (seed=None) on 2 TensorFlow workers" in refused.get(
            "adaptive_secret", ""), refused
        assert "over the 2 TensorFlow workers" in refused.get("sampler", ""), refused
        assert report["replicas"] == 2
        assert set(report["counts"].values()) == {2}, report["counts"]
        assert all(sizes == [4] * 4 for sizes in report["sizes"].values()), report["sizes"]
        _assert_as_one_device(report, moved=1e-2)


_TF_TWO_LEVEL = """
import contextlib, json
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
import pergrad, problems
from pergrad import aggregators

RULES = {
    # A median in each group, then clipping across the groups (its clipped_fraction logged).
    "two_level_2_clip": lambda: aggregators.two_level(2, across=aggregators.clip(0.5)),
    "two_level_4": lambda: aggregators.two_level(4),  # a median of medians
}
gathered = []  # the shapes every replica all-gathers
original = pergrad.distributed.replicas.gather

def recording(value):
    gathered.append(value.shape[0])
    return original(value)

pergrad.distributed.replicas.gather = recording

def train(rule, strategy):
    with strategy.scope() if strategy else contextlib.nullcontext():
        problem = problems.dense_mlp(batch=16)
        model = pergrad.PerExampleModel(problem.model, RULES[rule]())
        model.compile(optimizer="sgd", loss=problem.loss)
    del gathered[:]
    # 13 examples in batches of 8: shards 4 + 4, then 3 + 2 (R = 2); 2 + 2 + 2 + 2, then
    # 2 + 2 + 1 + 0 (R = 4: an empty shard, an empty group).
    history = model.fit(problem.x[:13], problem.y[:13], sample_weight=problem.sample_weight[:13],
                        batch_size=8, epochs=2, shuffle=False, verbose=0)
    spread = max(
        float(np.max(np.abs(parts[0].numpy() - part.numpy())))
        for parts in (getattr(v.value, "values", (v.value,)) for v in model.weights)
        for part in parts
    )
    logs = {k: v[-1] for k, v in history.history.items()}
    return problem.model.get_weights(), logs, spread, sorted(set(map(str, gathered)))

def difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))

two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
four = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)],
                                      cross_device_ops=tf.distribute.ReductionToOneDevice())
report = {"several": {}, "moved": {}}
for rule, runs in [("two_level_2_clip", [(2, two)]), ("two_level_4", [(4, four), (2, two)])]:
    alone, logs, _, _ = train(rule, None)
    report["moved"][rule] = difference(alone, problems.dense_mlp(batch=16).model.get_weights())
    for replicas, strategy in runs:
        weights, other_logs, spread, leading = train(rule, strategy)
        report["several"][f"{rule}/{replicas}"] = [
            difference(weights, alone), max(abs(logs[k] - other_logs[k]) for k in logs),
            sorted(logs) == sorted(other_logs), spread, leading]
print(json.dumps(report))
"""


@_only("tensorflow")
def test_tensorflow_mirrored_strategy_two_level():
    # two_level(groups=R) on R MirroredStrategy replicas: each replica's shard is one
    # group, and only the R local results are all-gathered (every gathered tensor has
    # one row: not the per-example gradients); the weights and logs are those of one
    # device with the same rule, uneven shards and an empty one included. With groups
    # != R the rule runs on the gathered batch, as every arbitrary rule, still exact.
    report = _run(_TF_TWO_LEVEL, "tensorflow")
    assert min(report["moved"].values()) > 1e-3, report["moved"]
    assert sorted(report["several"]) == ["two_level_2_clip/2", "two_level_4/2", "two_level_4/4"]
    for key, (difference, logs, same_logs, spread, leading) in report["several"].items():
        assert difference <= 1e-5 and logs <= 1e-5 and same_logs and spread == 0.0, (key, report)
        cheap = key in ("two_level_2_clip/2", "two_level_4/4")
        # The local results and shard sizes: one row per replica; else the whole batch.
        assert (leading == ["1"]) == cheap, (key, leading)
