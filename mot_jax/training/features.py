"""The feature cache (`data.feature_cache`): the frozen models' outputs that a KV-space objective needs,
computed once per chunk table and read from disk, so that such objectives train without the frozen forwards.

With `loss.ce_weight=0` and no distill (`LossWeights.reads_prompt` False) a training step needs from the frozen
models only what does not depend on the translator (`frozen_inputs`): the source's cache of the context (and its
attention top-k for sparse replay) and the target's native cache of the context (`objective.frozen_forwards`), with
`loss.attention_weight` its native reads of the prompt (`objective.NativeReads`), and what `translate` reads from the
target (`translator.TargetSide`: the native bottom layers' K/V, the target-side inputs, the first token's own K/V).
`build` computes them for every chunk of a table (batched, jitted, a progress meter) into the shared cache,
`FeatureTable.take` reads a batch's rows, and the trainer's step takes them from `Batch.features` in place of running
the frozen forwards. Replay still runs the target over its context (with the translation injected), C2C fuses into
the stored native cache.

Stored in the dtype the models compute in (float32 or bfloat16), so the step reads what it would have computed; only
the layers the step reads are kept (the source layers the translator reads, the target layers the losses compare).
On disk: `DATA_DIR/features/NAME/` (DATA_DIR: data.data_dir, default the shared cache $MOT_JAX_CACHE), NAME a hash of
everything the features depend on (the models and dtype, the chunks' tokens, their split and lengths, the
translator's spec, whether the attention reads are kept); one .npy per leaf, chunk axis first, and meta.json. Built
under the entry's lock into a temporary folder renamed into place: any number of processes build it once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct

from mot_jax.errors import MotJaxError, cause
from mot_jax.files import atomic_folder, remove_leftovers
from mot_jax.jit import jit
from mot_jax.paths import cache_lock, cache_root
from mot_jax.progress import Progress
from mot_jax.training import data, objective
from mot_jax.translate import kinds
from mot_jax.translate.window import target_side

FEATURE_FORMAT = 1  # bump when what is stored changes: old entries are then ignored


def frozen_inputs(source, target, batch, spec, kind: str, reads: bool):
    """(frozen, side): `objective.frozen_forwards` of the batch and its `TargetSide` (None for a kind that reads the
    target's own prefill, `Kind.receiver`: C2C fuses into the native cache), as the live step computes them."""
    frozen = objective.frozen_forwards(source, target, batch, spec.attention_topk, reads)
    capacity = batch.context.shape[1] + batch.prompt.shape[1]
    side = None if kinds.get(kind).receiver else target_side(spec, target, batch.context, batch.context_mask, capacity)
    return frozen, side


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the stored leaves (chunk axis first, kept layers only) become `frozen_inputs`' pytree again (static)."""

    treedef: object
    batch_axes: tuple  # per leaf, its batch axis in the pytree (None: the same for every row, stored per row)
    source_layers: tuple  # the source layers kept of `source_total`
    source_total: int
    target_layers: tuple  # the target layers kept (native cache, attention reads) of `target_total`
    target_total: int

    def trim(self, inputs):
        """`frozen_inputs`' pytree with only the kept layers."""
        (source, topk, native, *reads), side = inputs
        s, t = np.asarray(self.source_layers, int), np.asarray(self.target_layers, int)
        return (_layers(source, s, lambda x: x[s]), topk, _layers(native, t, lambda x: x[t]), *_reads(reads, t)), side

    def unpack(self, leaves):
        """The stored leaves of a batch (chunk axis first) -> `frozen_inputs`' pytree (dropped layers zero)."""
        leaves = [x[0] if a is None else jnp.moveaxis(x, 0, a) for x, a in zip(leaves, self.batch_axes)]
        (source, topk, native, *reads), side = jax.tree.unflatten(self.treedef, leaves)
        s, t = np.asarray(self.source_layers, int), np.asarray(self.target_layers, int)
        grow = lambda keep, total: lambda x: jnp.zeros((total, *x.shape[1:]), x.dtype).at[keep].set(x)
        source = _layers(source, s, grow(s, self.source_total))
        native = _layers(native, t, grow(t, self.target_total))
        return (source, topk, native, *_reads(reads, t, grow(t, self.target_total))), side


def _layers(cache, keep, fn):
    return cache.replace(k=fn(cache.k), v=fn(cache.v))


def _reads(reads, keep, fn=None):
    fn = fn or (lambda x: x[keep])
    return [
        r.replace(queries=fn(r.queries), scale=fn(r.scale), window=fn(r.window), cache=_layers(r.cache, keep, fn))
        for r in reads
    ]


@struct.dataclass
class Features:
    """A batch's rows of a feature table (a pytree: stacked, placed and scanned over like the batch)."""

    leaves: tuple  # chunk axis first
    layout: Layout = struct.field(pytree_node=False)

    def unpack(self):
        """(frozen, side) as `frozen_inputs` returns them (inside the step)."""
        return self.layout.unpack(self.leaves)


class FeatureTable:
    """The stored features of a table's chunks (memory-mapped): `take(indices)` -> their `Features`."""

    def __init__(self, path: Path, layout: Layout):
        meta = json.loads((path / "meta.json").read_text())
        self.path, self.layout, self.count = path, layout, meta["count"]
        self.dtypes = [jnp.dtype(d) for d in meta["dtypes"]]
        self.leaves = [np.load(path / f"leaf_{i}.npy", mmap_mode="r") for i in range(len(self.dtypes))]

    def take(self, indices) -> Features:
        indices = np.asarray(indices)
        leaves = tuple(np.asarray(x[indices]).view(d) for x, d in zip(self.leaves, self.dtypes))
        for i, x in enumerate(leaves):  # what the frozen models gave is finite: this is damage on disk
            if jnp.issubdtype(x.dtype, jnp.inexact) and not np.isfinite(x).all():
                raise MotJaxError(
                    f"The feature cache file {self.path / f'leaf_{i}.npy'} holds non-finite values (damaged on disk); "
                    f"delete {self.path} and run again to rebuild it."
                )
        return Features(leaves, self.layout)


def _damage(path: Path) -> str | None:
    """What makes a built cache entry unreadable, naming the file (None: it reads)."""
    file = path / "meta.json"
    try:
        meta = json.loads(file.read_text())
        for i in range(len(meta["dtypes"])):
            file = path / f"leaf_{i}.npy"
            if len(np.load(file, mmap_mode="r")) != meta["count"]:
                return f"{file} does not hold {meta['count']} chunks"
    except (OSError, ValueError, KeyError, TypeError) as e:  # a missing, cut or overwritten file
        return f"{file}: {cause(e)}"
    return None


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode() + a.tobytes())
    return h.hexdigest()


def _stored(x):
    """An array as raw unsigned ints of its width (np.save cannot write bfloat16)."""
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def build(root: Path, key: dict, compute, batches: list, count: int, what: str) -> Path:
    """The cache entry of `key`: the first `count` rows of `compute(batch)` (stored leaves, chunk axis first) over
    `batches` (the last may end in padding rows), built first where missing."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = root / "features" / name
    if _damage(path):  # missing, or unreadable
        with cache_lock(path):  # another process may be building it: wait, then look again
            remove_leftovers(path)  # of a build that was killed
            damage = _damage(path)
            if damage and path.exists():
                logging.warning("The feature cache entry %s is damaged (%s); building it again.", path, damage)
            if damage:
                _write(path, key, compute, batches, count, what)
    logging.info("Feature cache of the %s (%d chunks): %s", what, count, path)
    return path


def _write(path: Path, key: dict, compute, batches: list, count: int, what: str):
    rows = len(batches[0].context)
    row_bytes = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(jax.eval_shape(compute, batches[0]))) / rows
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if row_bytes * count > free:
        raise MotJaxError(
            f"The feature cache of the {what} ({count} chunks) needs {row_bytes * count / 2**30:.1f} GiB and "
            f"{path.parent} has {free / 2**30:.1f} GiB free; lower --config.data.train_chunks or free space."
        )
    logging.info("Building the feature cache of the %s: %.2f GiB into %s", what, row_bytes * count / 2**30, path)
    with atomic_folder(path) as staging, Progress(f"Feature cache ({what})", "chunk", total=count) as progress:
        staging, files, done = Path(str(staging)), None, 0
        for batch in batches:
            leaves = [np.asarray(x) for x in jax.device_get(compute(batch))]
            if files is None:
                dtypes = [str(x.dtype) for x in leaves]
                files = [
                    np.lib.format.open_memmap(staging / f"leaf_{i}.npy", "w+", _stored(x).dtype, (count, *x.shape[1:]))
                    for i, x in enumerate(leaves)
                ]
            take = min(len(batch.context), count - done)
            for f, x in zip(files, leaves):
                f[done : done + take] = _stored(x[:take])
            done += take
            progress.update(take)
        for f in files:
            f.flush()
        del files
        (staging / "meta.json").write_text(json.dumps(dict(key=key, count=count, dtypes=dtypes), indent=1))


def table_key(config, pair, spec, kind: str, reads: bool, split: str, digest: str) -> dict:
    """Everything a table's features depend on."""
    return dict(
        format=FEATURE_FORMAT,
        source=config.source,
        target=config.target,
        source_model=dataclasses.asdict(pair.source.config),
        target_model=dataclasses.asdict(pair.target.config),
        dtype=config.dtype,
        spec=spec.to_dict(),
        c2c=kinds.get(kind).receiver,  # the name older tables were stored under
        reads=reads,
        split=split,
        data=digest,
    )


def make_layout(pair, spec, kind: str, reads: bool, batch) -> Layout:
    """The layout of `frozen_inputs` for this pair and spec (`batch`: any batch of two rows or more, for shapes)."""
    source_layers = tuple(sorted(set(spec.source_layers))) if spec.reads_source else ()
    num_target = pair.target.config.num_layers
    first = spec.native_bottom if spec.mode == "direct" else min(spec.target_layers)  # the layers the losses read
    # a kind that reads the target's own prefill (C2C fuses into it) needs every layer of it
    target_layers = tuple(range(0 if kinds.get(kind).receiver else first, num_target))
    layout = Layout(None, (), source_layers, pair.source.config.num_layers, target_layers, num_target)

    def shapes(rows):
        b = jax.tree.map(lambda x: x[:rows], batch)
        return jax.eval_shape(lambda x: layout.trim(frozen_inputs(pair.source, pair.target, x, spec, kind, reads)), b)

    one, two = shapes(1), shapes(2)
    axes = tuple(
        next((i for i, (p, q) in enumerate(zip(a.shape, b.shape)) if p != q), None)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two))
    )
    return dataclasses.replace(layout, treedef=jax.tree.structure(one), batch_axes=axes)


def attach_features(config, pair, spec, kind: str, stream: data.Batches, validation: list):
    """(the training stream, the validation batches) reading their chunks' features from the cache (built first
    where missing)."""
    if spec.source_reads is not kinds.KV:
        raise MotJaxError(
            f"data.feature_cache does not cover kind={kind!r} (the source hands over hidden states); pass "
            "--config.data.feature_cache=false."
        )
    reads = bool(objective.LossWeights.from_config(config.loss).attention)
    layout = make_layout(pair, spec, kind, reads, stream.batch(0))

    @jit
    def stored(source, target, batch):
        leaves = jax.tree.leaves(layout.trim(frozen_inputs(source, target, batch, spec, kind, reads)))
        rows = batch.context.shape[0]
        return [
            jnp.broadcast_to(x, (rows, *x.shape)) if a is None else jnp.moveaxis(x, a, 0)
            for x, a in zip(leaves, layout.batch_axes)
        ]

    compute = lambda batch: stored(pair.source, pair.target, batch)
    root, size, chunks = Path(config.data.data_dir or cache_root()), config.batch_size, stream.chunks
    table_batches = [  # the table in order, in batches of the training size (the last padded by wrapping around)
        data.make_batch(
            np.resize(chunks[i : i + size], (size, chunks.shape[1])),
            stream.prefix_tokens,
            stream.source_tokenizer,
            stream.target_tokenizer,
            stream.source_length,
        )
        for i in range(0, len(chunks), size)
    ]
    digest = _digest(chunks, np.asarray([stream.prefix_tokens, stream.source_length]))
    key = table_key(config, pair, spec, kind, reads, "train", digest)
    train = FeatureTable(build(root, key, compute, table_batches, len(chunks), "training chunks"), layout)
    if not validation:
        return CachedStream(stream, train), validation
    key = table_key(config, pair, spec, kind, reads, "validation", _digest(*jax.tree.leaves(validation)))
    rows = len(validation[0].context)
    val = FeatureTable(build(root, key, compute, validation, rows * len(validation), "validation batches"), layout)
    validation = [
        dataclasses.replace(b, features=val.take(np.arange(i * rows, (i + 1) * rows))) for i, b in enumerate(validation)
    ]
    return CachedStream(stream, train), validation


class CachedStream:
    """A training stream (`data.Batches`) whose batches carry their chunks' features."""

    def __init__(self, stream: data.Batches, table: FeatureTable):
        self.stream, self.table = stream, table

    def batch(self, position: int):
        rows = self.stream.indices(position)[self.stream.rows]
        return dataclasses.replace(self.stream.batch(position), features=self.table.take(rows))
