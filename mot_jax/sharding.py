"""The device mesh and the one table that maps logical axis names (on parameters, activations, caches) to it.

Mesh axes: `data` (batch; optionally FSDP for the frozen LLMs) and `expert` (translator experts). Parameters carry
logical names in their `out_sharding` metadata (see `mot_jax.models.layers.param`); `shard` places a module's
parameters by those names, and jit then partitions the computation (expert parallelism over `expert`).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mot_jax.errors import MotJaxError

# logical axis -> mesh axis (absent: replicated)
RULES = {"batch": "data", "expert": "expert"}
FSDP_RULES = {**RULES, "embed": "data"}  # frozen LLM weights split over `data` for targets too big to replicate


def make_mesh(data: int = -1, expert: int = 1, devices=None) -> jax.sharding.Mesh:
    """A (data, expert) mesh over `devices` (default all); -1 for `data` takes what `expert` leaves."""
    devices = jax.devices() if devices is None else devices
    if expert < 1 or len(devices) % expert:
        raise MotJaxError(f"expert={expert} does not divide the {len(devices)} devices; choose a divisor.")
    data = len(devices) // expert if data == -1 else data
    if data * expert != len(devices):
        raise MotJaxError(f"A mesh of data={data} x expert={expert} needs {data * expert} devices, not {len(devices)}.")
    return jax.sharding.Mesh(np.asarray(devices).reshape(data, expert), ("data", "expert"))


def spec(names, rules=RULES, shape=None, mesh=None) -> PartitionSpec:
    """PartitionSpec of a tuple of logical names; an axis whose size the mesh axis does not divide stays whole."""
    axes = []
    for i, name in enumerate(names or ()):
        axis = rules.get(name)
        if axis is not None and shape is not None and mesh is not None and shape[i] % mesh.shape[axis]:
            axis = None
        axes.append(axis if axis not in axes else None)
    return PartitionSpec(*axes)


def shard(module, mesh, rules=RULES):
    """Place every parameter of `module` on `mesh` by its logical axis names (in place); returns the module."""
    for _, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        names = var.get_metadata().get("out_sharding")
        sharding = NamedSharding(mesh, spec(names, rules, var.shape, mesh))
        var.set_value(jax.device_put(var[...], sharding))
    return module
