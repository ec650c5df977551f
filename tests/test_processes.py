"""Several JAX processes (hosts) train one model: the one-process result, the DP guarantee intact.

Two processes join on 127.0.0.1 (``keras.distribution.initialize``, CPU collectives by gloo),
one CPU device each, ``DataParallel`` over both, and run tests/process_runs.py once: every
rule, DP-SGD on both data layouts, a secret key with a budget, a restart, the sampler's
draws, the refusals. This process computes the one-process results meanwhile, with the same
functions, and the tests below read the reports. JAX only: ``keras.distribution`` runs one
program over several processes there (TensorFlow's workers: tests/test_distributed.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import process_runs
from conftest import BACKEND
from process_runs import difference

pytestmark = pytest.mark.skipif(
    BACKEND != "jax", reason="several processes run one program through keras.distribution on JAX only"
)

TESTS = pathlib.Path(__file__).resolve().parent
TIMEOUT = 600  # seconds for both processes; they take about 30 s of CPU each


class _Pair:
    """The two processes of tests/process_runs.py, started at once; their JSON reports."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self.attempt = 0
        self._start()

    def _start(self):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        environment = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
        environment.pop("XLA_FLAGS", None)  # one CPU device per process
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH")]))
        self.attempt += 1
        self.logs = [self.directory / f"process_{i}_attempt_{self.attempt}" for i in range(2)]
        self.processes = []
        for process, log in enumerate(self.logs):
            with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
                self.processes.append(subprocess.Popen(
                    [sys.executable, str(TESTS / "process_runs.py"), str(process), str(port),
                     str(self.directory)], env=environment, stdout=out, stderr=err))
        self.deadline = time.monotonic() + TIMEOUT

    def kill(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()

    def _failure(self) -> str | None:
        """``None`` once both exited cleanly; else, as soon as one fails or time is up, both
        killed and what they wrote."""
        while True:
            codes = [process.poll() for process in self.processes]
            if codes == [0, 0]:
                return None
            if any(code not in (None, 0) for code in codes) or time.monotonic() > self.deadline:
                self.kill()
                return "\n".join(
                    f"process {i} (exit {process.returncode}): "
                    + pathlib.Path(f"{log}.err").read_text()[-3000:]
                    for i, (process, log) in enumerate(zip(self.processes, self.logs)))
            time.sleep(0.2)

    def reports(self) -> list[dict]:
        failure = self._failure()
        if failure is not None and self.attempt == 1 and "Failed to start RPC server" in failure:
            self._start()  # another program took the port between the probe and the bind
            failure = self._failure()
        assert failure is None, failure
        return [json.loads(pathlib.Path(f"{log}.out").read_text().strip().splitlines()[-1])
                for log in self.logs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(the two processes' reports, the one-process results)``."""
    pair = _Pair(tmp_path_factory.mktemp("processes"))
    try:
        single = process_runs.references()
    except BaseException:
        pair.kill()
        raise
    return pair.reports(), single


def _initial_weights():
    return process_runs.problem().model.get_weights()


def _same_logs(logs, reference, keys=None):
    keys = sorted(reference) if keys is None else keys
    assert sorted(logs) == sorted(reference), (sorted(logs), sorted(reference))
    for key in keys:
        assert np.allclose(logs[key], reference[key], rtol=0, atol=1e-6), (key, logs[key], reference[key])


def test_every_rule_on_two_processes_trains_as_on_one(runs):
    # Fixed batches (each process its contiguous half of every global batch of 8): mean, clip,
    # median (the streaming path's all-to-alls), Krum (the Gram matrix's all-gathers).
    # Poisson-sampled DP rules: dp_gaussian, user-level DP (a user's examples on both
    # processes), adaptive clipping (its count summed over the processes), BandMF on a
    # CyclicPoissonSampler (its noise buffer carried by both): the weights, epsilon, the loss
    # and the rule's logs of one process.
    reports, single = runs
    initial = _initial_weights()
    for rule in process_runs.FIXED_RULES + process_runs.DP_RULES:
        assert difference(single[rule][0], initial) > 1e-2, rule  # the weights moved
    for report in reports:
        assert (report["processes"], report["devices"]) == (2, 2)
        for rule in process_runs.FIXED_RULES:
            assert difference(report["fixed"][rule], single[rule][0]) <= 1e-6, rule
        for rule in process_runs.DP_RULES:
            weights, logs, steps = report[rule][:3]
            assert difference(weights, single[rule][0]) <= 1e-6, rule
            assert steps == single[rule][2] == 8, rule
            _same_logs(logs, single[rule][1])
        assert "clipped_fraction" in report["dp_gaussian"][1] and "l2_norm_clip" in report["adaptive"][1]
    assert reports[0]["fixed"] == reports[1]["fixed"]  # one model, the same weights everywhere


def test_dp_sgd_is_one_process_run_whether_processes_hold_the_data_or_a_shard_each(runs):
    # The same seeds: every process holding all 32 examples (each feeding its part of the one
    # global Poisson sample) and each holding 16 (dataset_size=32: each samples its shard, the
    # union the one-process sample) give one process's weights and epsilon. The shard layout
    # pads each part to the largest shard's bound (another padded size: its logged loss,
    # averaged over the padded rows, differs; epsilon and the diagnostics do not).
    reports, single = runs
    for report in reports:
        for layout in ("dp_gaussian", "sharded"):
            weights, logs, steps = report[layout][:3]
            assert difference(weights, single["dp_gaussian"][0]) <= 1e-6, layout
            assert steps == 8, layout
            keys = ["epsilon", "clipped_fraction", "gradient_norm"]
            keys += ["loss"] if layout == "dp_gaussian" else []
            _same_logs(logs, single["dp_gaussian"][1], keys)
    assert reports[0]["sharded"] == reports[1]["sharded"]


def test_a_model_parallel_layout_over_the_processes_trains_as_one_process(runs):
    # ModelParallel on a 1 x 2 mesh: the hidden kernel split over the two processes, the
    # batch over none (both feed the whole global batch: the sampler's part (0, 1)).
    reports, single = runs
    for report in reports:
        weights, logs, steps, spec, devices = report["model_parallel"]
        assert "'model'" in spec and devices == 2, (spec, devices)
        assert difference(weights, single["dp_gaussian"][0]) <= 1e-6
        assert steps == 8
        _same_logs(logs, single["dp_gaussian"][1])


def test_one_secret_key_per_run_never_saved_and_fresh_after_a_restore(runs):
    # seed=None for the noise and the sampler: drawn on process 0 and broadcast, so both
    # processes hold the same key and sampler seed and end with the same weights (before:
    # each drew its own and the step died in JAX's device_put). The saved model and weights
    # hold no two consecutive words of the key or of either half; loading the weights draws
    # a fresh key (the same on both), so that a restored run does not replay released noise.
    reports, _ = runs
    first, second = (report["secret"] for report in reports)
    for key in ("weights", "key", "sampler_seed", "reloaded_key", "after_reload"):
        assert first[key] == second[key], key
    for report in (first, second):
        assert report["scan_finds_a_planted_key"] is True
        assert report["key_in_files"] == [], report["key_in_files"]
        assert report["files"] == ["model.keras", "model.weights.h5"]
        assert report["reloaded_key"] != report["key"]
        assert report["reloaded_step_count"] == 5


def test_max_epsilon_stops_both_processes_at_the_same_step(runs):
    # The budget allows 5 steps of the 12 asked for: both processes stop after step 5 (the
    # step count is one replicated variable), and both log the epsilon of 5 steps.
    from pergrad import privacy

    reports, _ = runs
    expected = privacy.epsilon(process_runs.NOISE, process_runs.RATE, 5, process_runs.DELTA)
    for report in reports:
        secret = report["secret"]
        assert secret["steps"] == secret["step_count"] == 5
        assert secret["epsilon"][-1] == pytest.approx(expected, rel=1e-12)


def test_a_restart_from_a_checkpoint_trains_as_the_uninterrupted_run(runs):
    # The first epoch's weights (every process its own file) loaded again, a new sampler with
    # the same seed: the second epoch draws the same batches and noise (the step count
    # restored), ending with the uninterrupted run's weights and epsilon.
    reports, single = runs
    for report in reports:
        weights, logs, steps, resumed, resumed_logs, resumed_steps = report["dp_gaussian"]
        assert difference(resumed, weights) <= 1e-6
        assert difference(resumed, single["dp_gaussian"][0]) <= 1e-6
        assert resumed_steps == steps == 8
        assert resumed_logs["epsilon"] == logs["epsilon"][1:]


@pytest.mark.parametrize("layout", ["whole", "shard"])
def test_the_processes_draw_one_poisson_sample_per_step(runs, layout):
    # 200 steps of q = 0.1 over 200 examples, every process holding the whole data set or
    # a shard (120 and 80 examples). At every step the processes' parts are disjoint, their
    # union is the one-process sample of the same seed (no example twice in a global batch),
    # and both yield the same number of rows (one global array); over the steps each
    # example is included with probability q, independently from one step to the next.
    from scipy import stats

    from pergrad import privacy

    reports, _ = runs
    size, steps, rate = sum(process_runs.STATISTICS_SIZES), process_runs.STATISTICS_STEPS, 0.1
    one = privacy.PoissonSampler(np.zeros((size, 1), "float32"), np.arange(size), sampling_rate=rate, seed=11)
    (first, first_rows), (second, second_rows) = (report["statistics"][layout] for report in reports)
    assert first_rows == second_rows
    included = np.zeros((steps, size), bool)
    for step in range(steps):
        union = first[step] + second[step]
        assert len(set(union)) == len(union), step
        assert sorted(union) == one.indices_for_step(step).tolist(), step
        assert max(len(first[step]), len(second[step])) <= first_rows[step]
        if layout == "whole":  # contiguous parts of the sorted sample, sizes within one
            assert union == sorted(union) and abs(len(first[step]) - len(second[step])) <= 1
        included[step, union] = True
    assert len(set(first_rows)) > 1 if layout == "whole" else len(set(first_rows)) == 1
    assert stats.binomtest(int(included.sum()), included.size, rate).pvalue > 1e-3
    both = int(np.sum(included[1:] & included[:-1]))  # in two consecutive steps
    assert stats.binomtest(both, included[1:].size, rate**2).pvalue > 1e-3


def test_what_cannot_keep_the_guarantee_on_two_processes_is_refused(runs):
    reports, _ = runs
    expected = {
        "arrays": "takes its batches from pergrad.privacy.PoissonSampler",
        "no_distribution": "needs one keras.distribution over every process's devices",
        "different_data": "differ in the data set",
        "different_seeds": "differ in seed",
        "threads": "threads fetch steps out of order",
        "wrong_total": "shards hold [16, 16] examples, 32 in all",
        "same_shard": "two processes hold the same shard",
        "user_shard": "dataset_size (a shard per process) is not supported",
        "shard_counts_padding": "Clip counts the padding rows",
    }
    assert reports[0]["refusals"] == reports[1]["refusals"]
    refused = reports[0]["refusals"]
    assert refused.pop("arrays_unchanged") == 0.0  # refused before any weight moved
    assert sorted(refused) == sorted(expected)
    for key, phrase in expected.items():
        assert refused[key] is not None and phrase in refused[key], (key, refused[key])
        assert "\n" not in refused[key], key
