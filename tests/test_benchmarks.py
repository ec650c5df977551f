"""The benchmarks' own measurement code, where a wrong count would print a wrong table.

``benchmarks/replicas.py`` reads the bytes a step's collectives move from the
compiled HLO text (docs/architecture.md, 'Communication per step'); here it
counts collectives of known size on two forced XLA CPU devices, in a fresh
process (the device count is fixed before JAX is imported), once, in the JAX
session.
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
