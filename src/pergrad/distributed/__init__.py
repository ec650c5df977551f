"""Everything pergrad does on several devices, and nothing it does on one.

- :mod:`~pergrad.distributed.replicas`: the collectives of a train step that each of
  several ``tf.distribute`` replicas runs on its shard of the batch;
- :mod:`~pergrad.distributed.processes`: several JAX processes (hosts) running one global
  program: host-level collectives only, nothing in the train step.

(docs/multi-device.md.) Imports nothing here: importing a submodule stays cheap.
"""
