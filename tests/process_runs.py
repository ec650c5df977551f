"""The runs of tests/test_processes.py: one model on two JAX processes, and its one-process twin.

Run as a script, ``python process_runs.py PROCESS_ID PORT DIRECTORY``, it is one of two
processes joined by ``keras.distribution.initialize`` on 127.0.0.1 (CPU collectives by gloo),
each with one CPU device, training under ``DataParallel(devices=list_devices())``; it prints
a JSON report as its last line. Imported, its functions give the one-process results the
test compares with (``part, parts = 0, 1``, no distribution). The same functions serve both,
so that the two differ only in the processes.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys
import time
import warnings

if __name__ == "__main__":
    # keras.distribution.initialize seeds TensorFlow too when it can import it (seconds of
    # start-up per process): these processes never use it.
    sys.modules["tensorflow"] = None

import keras
import numpy as np

RATE, DELTA, NOISE, SAMPLER_SEED, NOISE_SEED = 0.25, 1e-5, 1.0, 3, 5
SIZE = 32  # examples of the DP runs; the fixed-batch runs use the first 16
FIXED_RULES = ("mean", "clip", "median", "krum")
DP_RULES = ("dp_gaussian", "user_level", "adaptive", "banded")
BANDS = 2  # the BandMF run: FHU of 2 bands on a CyclicPoissonSampler of cycle 2
USERS, PER_USER = 8, 4  # the user-level run: 8 users of 4 examples
STATISTICS_STEPS = 200  # the sampler's draws recorded for the statistical tests
STATISTICS_SIZES = (120, 80)  # the two shards of the sharded statistics run (200 examples)


def problem():
    import problems

    return problems.dense_mlp(batch=SIZE)  # x (32, 5), 3 classes, sample weights; seeded


def difference(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(u, np.float64) - v))) for u, v in zip(a, b))


def digest(arrays) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def fixed_rule(name):
    from pergrad import aggregators

    return {"mean": "mean", "clip": aggregators.clip(0.5), "median": "median",
            "krum": aggregators.krum(0.25)}[name]


def train_fixed(name: str, part: int = 0, parts: int = 1):
    """Two epochs of global batches of 8 of the first 16 examples, each process feeding its
    contiguous part of every batch (the issue's measured setup); the weights."""
    import pergrad

    data = problem()
    model = pergrad.PerExampleModel(data.model, fixed_rule(name))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=data.loss)
    local = 8 // parts
    rows = np.concatenate([np.arange(b * 8 + part * local, b * 8 + (part + 1) * local) for b in range(2)])
    model.fit(data.x[rows], data.y[rows], sample_weight=data.sample_weight[rows], batch_size=local,
              epochs=2, shuffle=False, verbose=0)
    return data.model.get_weights()


def dp_sampler(data, seed=SAMPLER_SEED, shard=None, **options):
    """The DP runs' sampler: batches of 16 rows (one shape: one compiled step; the statistics
    run checks the processes' buckets); ``shard``: ``(part, parts)`` for a process holding its
    contiguous shard of the data set."""
    from pergrad import privacy

    if shard is None:
        return privacy.PoissonSampler(data.x, data.y, sample_weight=data.sample_weight, sampling_rate=RATE,
                                      seed=seed, bucket_width=16, max_batch_size=16, **options)
    rows = np.array_split(np.arange(SIZE), shard[1])[shard[0]]
    return privacy.PoissonSampler(data.x[rows], data.y[rows], sample_weight=data.sample_weight[rows],
                                  sampling_rate=RATE, seed=seed, dataset_size=SIZE, **options)


def dp_model(name, data, expected, seed=NOISE_SEED, net=None):
    import pergrad
    from pergrad import privacy

    rule = {
        "dp_gaussian": lambda: privacy.dp_gaussian(0.5, NOISE, expected_batch_size=expected, seed=seed,
                                                   diagnostics=True),
        "user_level": lambda: privacy.user_level_dp_gaussian(0.5, NOISE, expected_batch_size=expected,
                                                             seed=seed),
        "adaptive": lambda: privacy.adaptive_dp_gaussian(0.3, NOISE, expected_batch_size=expected,
                                                         count_stddev=1.0, seed=seed),
        "banded": lambda: privacy.banded_mf_gaussian(0.5, NOISE, bands=BANDS, expected_batch_size=expected,
                                                     seed=seed),
    }[name]()
    model = pergrad.PerExampleModel(data.model if net is None else net, rule)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=data.loss)
    return model


class Counter(keras.callbacks.Callback):
    """Counts the steps run (independently of any step variable)."""

    steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


class SaveAt(keras.callbacks.Callback):
    """Saves the weights at the end of epoch ``epoch`` (every process its own file)."""

    def __init__(self, epoch, path):
        super().__init__()
        self.epoch, self.path = epoch, path

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.save_weights(self.path)


def train_dp(name: str, shard=None, net=None, checkpoint=None, weights=keras.Model.get_weights):
    """Two epochs (4 steps each) of Poisson-sampled DP-SGD with seeded batches and noise:
    ``[weights, logs (epsilon, loss, dp_gaussian's diagnostics), step count]``. With
    ``checkpoint``, the weights after the first epoch are saved there, then loaded into the
    model again and the second epoch trained from them with a new sampler (a restart): its
    ``[weights, logs, step count]`` follow."""
    from pergrad import privacy

    data = problem()
    if name == "user_level":
        users = np.repeat(np.arange(USERS), PER_USER)
        sampler = privacy.UserSampler(data.x, data.y, users=users, sample_weight=data.sample_weight,
                                      sampling_rate=0.5, examples_per_user=2, seed=SAMPLER_SEED,
                                      bucket_width=16, max_batch_size=16, steps_per_epoch=4)
        rate = 0.5
    elif name == "banded":
        rate = RATE * BANDS  # a group's rate: each example's participations are BANDS steps apart
        sampler = privacy.CyclicPoissonSampler(data.x, data.y, sample_weight=data.sample_weight,
                                               sampling_rate=rate, cycle_length=BANDS, seed=SAMPLER_SEED,
                                               bucket_width=16, max_batch_size=16, steps_per_epoch=4)
    else:
        sampler, rate = dp_sampler(data, shard=shard), RATE
    model = dp_model(name, data, sampler.expected_batch_size, net=net)
    unit = "user" if name == "user_level" else "example"
    accountant = privacy.PrivacyAccountant(NOISE, rate, DELTA, unit=unit,
                                           cycle_length=BANDS if name == "banded" else None)

    def fit(sampler, callbacks, initial_epoch=0):
        history = model.fit(sampler, epochs=2, initial_epoch=initial_epoch, verbose=0, callbacks=callbacks)
        steps = int(keras.ops.convert_to_numpy(model.aggregator.step_count))
        return [weights(model.model), history.history, steps]

    if checkpoint is None:
        return fit(sampler, [accountant])
    result = fit(sampler, [SaveAt(0, checkpoint), accountant])
    model.load_weights(checkpoint)  # the first epoch's weights and step count
    return result + fit(dp_sampler(data), [accountant], initial_epoch=1)


def references() -> dict:
    """The one-process results: every rule's weights (and the DP runs' logs and step counts)."""
    report = {rule: [train_fixed(rule)] for rule in FIXED_RULES}
    report.update({rule: list(train_dp(rule)) for rule in DP_RULES})
    return report


def gathered_weights(net):
    """``net``'s weights, those sharded over both processes gathered (``get_weights`` reads
    only arrays this process holds whole)."""
    from jax.experimental import multihost_utils

    return [np.asarray(multihost_utils.process_allgather(v.value, tiled=True)) for v in net.weights]


def model_parallel():
    """The DP run under ``ModelParallel`` on a 1 x 2 mesh: the hidden layer's columns and the
    output layer's rows split over the two processes, the batch over none (both feed the
    whole of every global batch)."""
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=devices)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*hidden/kernel"] = (None, "model")
    layouts[".*hidden/bias"] = ("model",)
    layouts[".*out/kernel"] = ("model", None)
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layouts, batch_dim_name="batch", auto_shard_dataset=False))
    try:
        keras.utils.set_random_seed(0)  # the initial weights of problems.dense_mlp
        net = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, "tanh", name="hidden"),
                                keras.layers.Dense(3, name="out")])
        result = train_dp("dp_gaussian", net=net, weights=gathered_weights)
        kernel = net.trainable_variables[0].value
        return result + [str(kernel.sharding.spec), len(kernel.sharding.device_set)]
    finally:
        keras.distribution.set_distribution(previous)


# -- the two-process side -----------------------------------------------------------------------


def refusal(call) -> str | None:
    """The ValueError ``call`` raises (its message), else ``None``."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def recorded_draws(sampler, model, steps):
    """The examples (their ``y``: global indices) this process yields at each of ``steps``
    steps inside a ``fit``'s split, and the rows of each batch."""
    import pergrad

    draws, rows = [], []
    with sampler.split_for(model, pergrad.distributed.replicas.batch_shards(model)):
        for _ in range(steps):
            _, labels, weights = sampler[0]
            draws.append([int(v) for v in labels[weights > 0]])
            rows.append(len(weights))
    return draws, rows


def statistics_draws(process):
    """The draws of both layouts over STATISTICS_STEPS steps: every process the whole data
    set (y = 0..199), and each its shard (120 and 80 examples)."""
    import pergrad
    from pergrad import privacy

    size = sum(STATISTICS_SIZES)
    x, y = np.zeros((size, 1), "float32"), np.arange(size)
    net = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model = pergrad.PerExampleModel(net, privacy.dp_gaussian(1.0, 1.0, expected_batch_size=0.1 * size))
    whole = privacy.PoissonSampler(x, y, sampling_rate=0.1, seed=11)
    start = sum(STATISTICS_SIZES[:process])
    rows = np.arange(start, start + STATISTICS_SIZES[process])
    shard = privacy.PoissonSampler(x[rows], y[rows], sampling_rate=0.1, seed=11, dataset_size=size)
    return {"whole": recorded_draws(whole, model, STATISTICS_STEPS),
            "shard": recorded_draws(shard, model, STATISTICS_STEPS)}


def key_in_files(words, directory) -> list[str]:
    """The files under ``directory`` (``.keras`` archives opened) holding two consecutive
    words of ``words`` (int32) as bytes."""
    import zipfile

    pairs = [words[i:i + 2].astype("<i4").tobytes() for i in range(len(words) - 1)]
    found = []
    for path in sorted(pathlib.Path(directory).iterdir()):
        blobs = [path.read_bytes()]
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                blobs += [archive.read(name) for name in archive.namelist()]
        if any(pair in blob for pair in pairs for blob in blobs):
            found.append(path.name)
    return found


def secret_run(process, directory):
    """DP-SGD with a secret noise key and a secret sampler seed, a budget that stops it after
    5 of 12 steps, the model saved; then reloaded (a fresh key) and one step more."""
    from pergrad import privacy

    data = problem()
    sampler = privacy.PoissonSampler(data.x, data.y, sample_weight=data.sample_weight, sampling_rate=RATE,
                                     bucket_width=16, max_batch_size=16)
    model = dp_model("dp_gaussian", data, sampler.expected_batch_size, seed=None)
    rule = model.aggregator
    budget = privacy.epsilon(NOISE, RATE, 5, DELTA) + 1e-9
    counter = Counter()
    history = model.fit(sampler, epochs=3, verbose=0, callbacks=[
        privacy.PrivacyAccountant(NOISE, RATE, DELTA, max_epsilon=budget), counter])
    saved = pathlib.Path(directory) / f"secret_{process}"
    saved.mkdir()
    model.save(saved / "model.keras")
    model.save_weights(saved / "model.weights.h5")
    key = np.asarray(keras.ops.convert_to_numpy(rule._key()))
    halves = [np.asarray(rule._hidden_key), np.asarray(keras.ops.convert_to_numpy(rule.noise_key))]
    report = {
        "weights": digest(data.model.get_weights()), "steps": counter.steps,
        "step_count": int(keras.ops.convert_to_numpy(rule.step_count)), "epsilon": history.history["epsilon"],
        "key": digest([key]), "sampler_seed": digest([np.array([sampler._entropy % 2**64], np.uint64)]),
        "key_in_files": [name for words in [key, *halves] for name in key_in_files(words, saved)],
        "files": sorted(p.name for p in saved.iterdir()),
    }
    planted = pathlib.Path(directory) / f"planted_{process}"  # the scan finds what it looks for
    planted.mkdir()
    (planted / "key.bin").write_bytes(b"words: " + key.astype("<i4").tobytes())
    report["scan_finds_a_planted_key"] = key_in_files(key, planted) == ["key.bin"]
    model.load_weights(saved / "model.weights.h5")  # the step count back to 5, a fresh key
    report["reloaded_key"] = digest([np.asarray(keras.ops.convert_to_numpy(rule._key()))])
    report["reloaded_step_count"] = int(keras.ops.convert_to_numpy(rule.step_count))
    model.fit(sampler, epochs=1, steps_per_epoch=1, verbose=0)
    report["after_reload"] = digest(data.model.get_weights())
    return report


def refusals(process, directory) -> dict:
    """What cannot keep the guarantee on two processes is refused, before any step."""
    import pergrad
    from pergrad import aggregators, privacy

    data = problem()
    found = {}
    sampler = dp_sampler(data)
    model = dp_model("dp_gaussian", data, sampler.expected_batch_size)
    before = data.model.get_weights()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not Poisson-sampled
        found["arrays"] = refusal(lambda: model.fit(data.x[:8], data.y[:8], batch_size=4, verbose=0))
    found["arrays_unchanged"] = difference(data.model.get_weights(), before)
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)  # each process its own model
    try:
        local = dp_model("dp_gaussian", problem(), sampler.expected_batch_size)
        found["no_distribution"] = refusal(lambda: local.fit(sampler, epochs=1, verbose=0))
    finally:
        keras.distribution.set_distribution(distribution)
    found["different_data"] = refusal(lambda: privacy.PoissonSampler(
        data.x + process, data.y, sampling_rate=RATE, seed=1))
    found["different_seeds"] = refusal(lambda: privacy.PoissonSampler(
        data.x, data.y, sampling_rate=RATE, seed=process))
    found["threads"] = refusal(lambda: privacy.PoissonSampler(
        data.x, data.y, sampling_rate=RATE, seed=1, workers=2))
    half = np.arange(SIZE // 2)
    mine = half + process * (SIZE // 2)
    found["wrong_total"] = refusal(lambda: privacy.PoissonSampler(
        data.x[mine], data.y[mine], sampling_rate=RATE, seed=1, dataset_size=SIZE + 1))
    found["same_shard"] = refusal(lambda: privacy.PoissonSampler(
        data.x[half], data.y[half], sampling_rate=RATE, seed=1, dataset_size=SIZE))
    found["user_shard"] = refusal(lambda: privacy.UserSampler(
        data.x, data.y, users=np.arange(SIZE) // 4, sampling_rate=RATE, examples_per_user=2, dataset_size=64))
    clip = pergrad.PerExampleModel(problem().model, aggregators.clip(0.5))
    clip.compile(optimizer="sgd", loss=data.loss)
    found["shard_counts_padding"] = refusal(lambda: clip.fit(dp_sampler(data, shard=(process, 2)), verbose=0))
    return found


def main(process: int, port: int, directory: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    started = time.time()
    keras.distribution.initialize(job_addresses=f"127.0.0.1:{port}", num_processes=2, process_id=process)
    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False))
    report = {"process": jax.process_index(), "processes": jax.process_count(), "devices": len(devices),
              "seconds": {"start": time.time() - started}}

    def timed(name, call):
        import resource
        begun, cpu = time.time(), resource.getrusage(resource.RUSAGE_SELF)
        result = call()
        after = resource.getrusage(resource.RUSAGE_SELF)
        report["seconds"][name] = [round(time.time() - begun, 2),
                                   round(after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime, 2)]
        return result

    report["fixed"] = timed("fixed", lambda: {rule: train_fixed(rule, process, 2) for rule in FIXED_RULES})
    checkpoint = str(pathlib.Path(directory) / f"dp_epoch_1_{process}.weights.h5")
    report["dp_gaussian"] = timed("dp", lambda: train_dp("dp_gaussian", checkpoint=checkpoint))
    report["sharded"] = timed("sharded", lambda: train_dp("dp_gaussian", shard=(process, 2)))
    report["user_level"] = timed("user_level", lambda: train_dp("user_level"))
    report["adaptive"] = timed("adaptive", lambda: train_dp("adaptive"))
    report["banded"] = timed("banded", lambda: train_dp("banded"))
    report["model_parallel"] = timed("model_parallel", model_parallel)
    report["secret"] = timed("secret", lambda: secret_run(process, directory))
    report["statistics"] = timed("statistics", lambda: statistics_draws(process))
    report["refusals"] = timed("refusals", lambda: refusals(process, directory))
    report["seconds"]["total"] = round(time.time() - started, 2)
    print(json.dumps(report, default=lambda a: np.asarray(a).tolist()))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
