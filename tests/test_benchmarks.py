"""The benchmarks' own measurement code, where a wrong count would print a wrong table.

``benchmarks/replicas.py`` reads the bytes a step's collectives move from the
compiled HLO text (the docs' 'Communication per step'); here it
counts collectives of known size on two forced XLA CPU devices, in a fresh
process (the device count is fixed before JAX is imported), once, in the JAX
session. On TensorFlow it records the sizes of the tensors the collectives
produce at run time (``TFCounter``); here an all-gather of uneven shards and an
all-reduce on two logical CPU devices, once, in the TensorFlow session.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import BACKEND

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"

_KNOWN_COLLECTIVES = """
import json
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import replicas

mesh = Mesh(jax.devices()[:2], ("i",))

def step(x):  # x: this device's (4, 3) float32 block
    total = jax.lax.psum(x, "i")  # an all-reduce of 48 bytes
    rows = jax.lax.all_gather(x[:, 0], "i", tiled=True)  # an all-gather: 8 floats, 32 bytes
    # an all-reduce of 4 bytes in a loop of 3 iterations: 3 executions
    loop = jax.lax.fori_loop(0, 3, lambda k, c: jax.lax.psum(c * 0.5, "i"), jnp.sum(x))
    return total, rows, loop

function = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("i"), out_specs=(P(), P(), P()),
                                 check_vma=False))
text = function.lower(jnp.ones((8, 3), "float32")).compile().as_text()
print(json.dumps(replicas.hlo_collectives(text)))
"""


@pytest.mark.skipif(BACKEND != "jax", reason="runs its own JAX process once, in the jax session")
def test_hlo_byte_counter_counts_known_collectives():
    environment = dict(os.environ, JAX_PLATFORMS="cpu",
                       XLA_FLAGS="--xla_force_host_platform_device_count=2",
                       PYTHONPATH=str(BENCHMARKS))
    completed = subprocess.run([sys.executable, "-c", _KNOWN_COLLECTIVES], env=environment,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    found = json.loads(completed.stdout.strip().splitlines()[-1])
    assert found["counts"] == {"all-reduce": 4, "all-gather": 1}
    assert found["bytes"] == {"all-reduce": 48 + 3 * 4, "all-gather": 32}
    assert found["loop"] is False


_KNOWN_TF_COLLECTIVES = """
import json
import tensorflow as tf
import replicas

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
counter = replicas.TFCounter()
counter.install()

def step(x):  # x: this replica's (3, 5) float32 block
    context = tf.distribute.get_replica_context()
    rows = x[: 3 - 2 * context.replica_id_in_sync_group]  # uneven shards: 3 and 1 rows
    # TF gathers the shapes (2 x 2 int32: 16 bytes), then the shards padded to 3 rows
    # (6 x 5 float32: 120 bytes), and drops the padding
    gathered = context.all_gather(rows, axis=0)
    total = context.all_reduce("sum", x[0])  # 5 float32: 20 bytes
    return gathered, total

@tf.function
def function(x):
    return strategy.run(step, args=(x,))

values = strategy.experimental_distribute_values_from_function(lambda c: tf.ones((3, 5)))
counter.tracing = True
gathered, _ = function(values)
counter.tracing = False
static = replicas.tf_collectives(function.get_concrete_function(values).graph)
rows = strategy.experimental_local_results(gathered)[0].shape[0]
print(json.dumps({**counter.summary(), "rows": rows, "ops": static["ops"]}))
"""


@pytest.mark.skipif(BACKEND != "tensorflow",
                    reason="runs its own TF process once, in the tensorflow session")
def test_tf_byte_counter_counts_known_collectives():
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(BENCHMARKS))
    completed = subprocess.run([sys.executable, "-c", _KNOWN_TF_COLLECTIVES], env=environment,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    found = json.loads(completed.stdout.strip().splitlines()[-1])
    assert found["rows"] == 4  # the gathered shards, unpadded
    assert found["counts"] == {"all-gather": 2, "all-reduce": 1}
    assert found["bytes"] == {"all-gather": 16 + 120, "all-reduce": 20}
    assert found["ops"] == found["counts"]  # the graph's ops on replica 0, each counted


_PEER_CHECKS = """
import json, sys
import process

# as bench.py does: one thread, oneDNN off for the transformer, TF Privacy's tf_keras
process.before_backend_import(threads=1, models=["tfm4"])
import models, peers

results = []
for row in sys.argv[1:]:
    recipe, kind = row.split(":")
    results.append(peers.check(recipe, kind, f"{kind}4", *models.make_data(kind, 4)))
print(json.dumps(results))
"""

#: per session: the (recipe, model) pairs checked (the benchmark checks every row it times),
#: and the packages they need
_PEERS = {"tensorflow": (("tf-privacy:mlp", "tf-privacy:tfm"), ("tensorflow_privacy", "tf_keras")),
          "jax": (("jax-privacy:mlp", "jax-privacy:tfm", "jax-privacy-mb1:mlp"), ("jax_privacy",))}


@pytest.mark.skipif(BACKEND not in _PEERS,
                    reason="the DP peers run in the tensorflow (TF Privacy) and jax (jax-privacy) sessions")
def test_dp_peers_compute_the_noise_free_clipped_mean_of_pergrad_clip():
    """benchmarks/peers.py's check: one noise-free SGD(1) step of TF Privacy's fast gradient
    clipping / jax-privacy's make_private (vmap; microbatch 1 on the MLP) from the benchmark's
    weights equals pergrad clip(1)'s, on the MLP and the transformer."""
    import importlib.util

    rows, packages = _PEERS[BACKEND]
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (make install installs them: benchmarks/README.md)")
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(BENCHMARKS))
    completed = subprocess.run([sys.executable, "-c", _PEER_CHECKS, *rows], env=environment,
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    assert [f"{r['recipe']}:{r['model'][:3]}" for r in results] == list(rows)
    for result in results:
        assert result["ok"] and result["relative_difference"] < 1e-4, result
        assert result["largest_entry"] > 1e-3, result  # the step moved the weights
        assert result.get("fast_clipping", True), result  # TF Privacy: every layer registered
