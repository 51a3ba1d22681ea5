"""The device mesh and the one table that maps logical axis names (on parameters, activations, caches) to it.

Mesh axes: `data` (batch; optionally FSDP for the frozen LLMs and the translator), `expert` (translator experts) and
`tensor` (the frozen LLMs' attention heads and MLP, Megatron-style: q/k/v/gate/up split by their output columns,
o/down by their input rows, so a layer's only collective is the sum of its two row-split products). Parameters carry
logical names in their `out_sharding` metadata (see `mot_jax.models.layers.param`); `shard` places a module's
parameters by those names, and jit then partitions the computation (expert parallelism over `expert`). Checkpoint
loading (`mot_jax.models.registry`) creates the frozen LLMs' weights in those same shardings from the host, so a
weight too big for one device never sits whole on one.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mot_jax.errors import MotJaxError

# logical axis -> mesh axis (absent: replicated)
RULES = {"batch": "data", "expert": "expert"}
# the frozen LLMs' heads (query, KV, the KV cache's), MLP intermediate and vocabulary over `tensor` (a mesh without
# it, or of size 1, leaves them whole); the translator's own `heads` / `mlp` names stay off it (`translator_rules`)
MODEL_RULES = {**RULES, "heads": "tensor", "kv": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
FSDP_RULES = {**MODEL_RULES, "embed": "data"}  # frozen LLM weights split over `data` for targets too big to replicate
AXES = ("data", "expert", "tensor")  # `tensor` innermost: its devices the nearest neighbours on a TPU slice


def llm_rules(config) -> dict:
    """The rules for a run's frozen LLMs: FSDP-split over `data` when `config.mesh.fsdp`, else replicated over it;
    heads and MLP over `tensor` either way."""
    return FSDP_RULES if config.mesh.fsdp else MODEL_RULES


def translator_rules(config) -> dict:
    """The rules for the translator (and so its AdamW state): its `embed` axis over the mesh axis
    `config.mesh.translator_fsdp` names (`data` or `tensor`; "" with `mesh.fsdp`: `data`), the experts over `expert`.
    Over `tensor` its weights split where the frozen models' rows do not, so XLA keeps the translator's rows over
    `data` (over `data` as well, XLA may split its matmuls by the weights instead and keep every row on every chip)."""
    axis = config.mesh.get("translator_fsdp", "") or ("data" if config.mesh.fsdp else "")
    if axis not in ("", *AXES):
        raise MotJaxError(f"mesh.translator_fsdp={axis!r} is not a mesh axis; pass data, tensor or nothing.")
    return {**RULES, "embed": axis} if axis else RULES


def make_mesh(data: int = -1, expert: int = 1, devices=None, tensor: int = 1) -> jax.sharding.Mesh:
    """A (data, expert, tensor) mesh over `devices` (default all); -1 for `data` takes what the others leave."""
    devices = jax.devices() if devices is None else devices
    if expert < 1 or tensor < 1 or len(devices) % (expert * tensor):
        raise MotJaxError(
            f"expert={expert} x tensor={tensor} does not divide the {len(devices)} devices; choose divisors."
        )
    data = len(devices) // (expert * tensor) if data == -1 else data
    if data * expert * tensor != len(devices):
        raise MotJaxError(
            f"A mesh of data={data} x expert={expert} x tensor={tensor} needs {data * expert * tensor} devices, "
            f"not {len(devices)}."
        )
    return jax.sharding.Mesh(np.asarray(devices).reshape(data, expert, tensor), AXES)


def spec(names, rules=RULES, shape=None, mesh=None) -> PartitionSpec:
    """PartitionSpec of a tuple of logical names; with a `mesh`, an axis it lacks, or of size 1 (it splits nothing:
    a mesh without `tensor` and one with `tensor=1` give the same specs), or whose size its mesh axis does not divide,
    stays whole."""
    axes = []
    for i, name in enumerate(names or ()):
        axis = rules.get(name)
        if axis is not None and mesh is not None and mesh.shape.get(axis, 1) == 1:
            axis = None
        if axis is not None and shape is not None and mesh is not None and shape[i] % mesh.shape[axis]:
            axis = None
        axes.append(axis if axis not in axes else None)
    return PartitionSpec(*axes)


def param_sharding(var, mesh, rules=RULES) -> NamedSharding:
    """Where a parameter (or its abstract shape) lives on `mesh`: its logical axis names mapped by `rules`."""
    names = var.get_metadata().get("out_sharding")
    return NamedSharding(mesh, spec(names, rules, var.shape, mesh))


def shard(module, mesh, rules=RULES):
    """Place every parameter of `module` on `mesh` by its logical axis names (in place; a parameter already placed
    so, e.g. loaded onto the mesh, is left as it is); returns the module. An abstract module's parameters
    (`nnx.eval_shape`) get their shardings as ShapeDtypeStructs: no array is made (ahead-of-time compiles)."""
    for _, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        sharding, value = param_sharding(var, mesh, rules), var.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
        elif not (isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim)):
            var.set_value(jax.device_put(value, sharding))
    return module
