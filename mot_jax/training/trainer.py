"""The jitted training of one translator: `Trainer` (its train, eval and baseline steps over a mesh, and the state
they update) and `fit`, which runs the steps over a batch stream.

Frozen source and target LLMs (replicated, or FSDP-split over `data`; heads and MLP over `tensor`), translator
experts sharded over the `expert` mesh axis (the translator over `data` with FSDP), batches over `data`; one jitted
step does the frozen forwards, the Context Correction loss and its gradient for every micro-batch (a scan: gradient
accumulation) and one AdamW update. The steps are traced under the mesh (`jax.set_mesh`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mot_jax import sharding
from mot_jax.errors import MotJaxError
from mot_jax.models.hooks import Forward
from mot_jax.models.model_pair import ModelPair
from mot_jax.models.registry import resolve_dtype
from mot_jax.progress import metered
from mot_jax.training import checkpoint, data, objective
from mot_jax.training.optim import adamw
from mot_jax.translate import kinds
from mot_jax.translate.donors import donor_indices, regrid
from mot_jax.translate.linear_skip import RIDGE_GRID, choose_ridge, linear_skip_sums, solve_linear_skip
from mot_jax.translate.pipeline import runs_source
from mot_jax.translate.translator import KVTranslator


class Trainer:
    """The jitted train and eval steps of one translator shape over a mesh, and the state they update."""

    def __init__(self, config, pair: ModelPair, spec, tcfg, mesh, total_steps: int, abstract: bool = False):
        """`abstract`: the pair's models are abstract (`build_model(abstract=True)`) and the state is made of
        ShapeDtypeStructs in their shardings, no array anywhere: the steps then only trace, to be compiled ahead of
        time for devices this process does not drive (`mot_jax.aot`, a TPU topology)."""
        self.config, self.pair, self.mesh = config, pair, mesh
        # a translator that runs no source (the source-free control, self-prediction) reads the source's config alone
        # (its depth, whether it rotates keys): the steps neither run nor take its weights, only its shapes
        self.runs_source = runs_source(spec)
        # a source that is the target is one argument of the steps: passed twice, XLA would plan its weights twice
        frozen = (pair.source, pair.target) if self.runs_source and pair.source is not pair.target else (pair.target,)
        self.source_shapes = None if self.runs_source else shapes_of(pair.source)
        rules = sharding.llm_rules(config)
        for model in frozen:  # a no-op for weights loaded onto the mesh (`load_pair`)
            sharding.shard(model, mesh, rules)
            model.remat = config.remat
        make = lambda: KVTranslator(spec, tcfg, rngs=nnx.Rngs(config.seed))
        translator = nnx.eval_shape(make) if abstract else make()
        # with `mesh.fsdp` or `mesh.translator_fsdp`, it and its AdamW state split over `data` (or `tensor`)
        sharding.shard(translator, mesh, sharding.translator_rules(config))
        self.graphdef, params = nnx.split(translator, nnx.Param)
        self.llm_graphs, self.llm_states = zip(*(nnx.split(m) for m in frozen))
        self.tx, self.schedule = adamw(config.optim, total_steps)
        rng = jax.random.key_data(jax.random.key(config.seed))
        replicated = NamedSharding(mesh, PartitionSpec())
        # AdamW's moments in their parameters' shardings (left to XLA, zeros that read no input come out replicated)
        shapes = jax.eval_shape(self.tx.init, params)
        placed = optax.tree_map_params(
            self.tx, lambda _, p: p.sharding, shapes, params, transform_non_params=lambda _: replicated
        )
        opt_state = shapes if abstract else jax.jit(self.tx.init, out_shardings=placed)(params)
        self.state = dict(params=params, opt_state=opt_state, rng=rng)
        self.topk, self.reads_source = spec.attention_topk, spec.reads_source
        self.source_hands = spec.source_hands  # what the source hands over: K/V, layer inputs or last hidden states
        self.kind, self.total_steps = kinds.get(tcfg.kind), total_steps
        self.compute_dtype = resolve_dtype(config.dtype)
        self.weights = objective.LossWeights.from_config(config.loss)
        named = lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated
        state_sharding = jax.tree.map(named, self.state) | dict(opt_state=placed)  # fixed: the step compiles once
        if abstract:
            sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            self.state = jax.tree.map(sds, self.state, state_sharding)
        else:
            self.state = jax.device_put(self.state, state_sharding)
        # traced under the mesh (`on_mesh`): the attention entry then runs splash on each chip's rows and heads
        self._train = on_mesh(
            mesh, jax.jit(self._train_step, donate_argnums=(0,), out_shardings=(state_sharding, None))
        )
        self._eval = on_mesh(mesh, jax.jit(self._eval_step))
        self._baselines = on_mesh(mesh, jax.jit(self._baseline_step))
        self._skip_sums = on_mesh(mesh, jax.jit(self._skip_sums_step))

    # -- pure functions (traced) --
    def _models(self, params, llm_states):
        params = jax.tree.map(lambda p: p.astype(self.compute_dtype), params)
        translator = nnx.merge(self.graphdef, params)
        models = [nnx.merge(g, s) for g, s in zip(self.llm_graphs, llm_states)]
        return translator, models[0] if self.runs_source else self.source_shapes, models[-1]

    def _loss(self, params, llm_states, batch, noise=None, prompt=False):
        _, source, target = self._models(params, llm_states)
        reads, side = bool(self.weights.attention), None
        if batch.features is not None:  # the feature cache: the frozen forwards' outputs, read from disk
            frozen, side = batch.features.unpack()
        else:
            args = (self.topk, reads, self.runs_source)
            frozen = objective.frozen_forwards(source, target, batch, *args, **self.source_hands)

        def loss_fn(p):
            translator, _, _ = self._models(p, llm_states)
            args = (frozen, self.weights, noise, side, prompt)
            return objective.context_correction(translator, source, target, batch, *args)

        return loss_fn

    def _noise(self, state, micro_batches: int):
        """Each micro-batch's training noise of the kind (`Kind.noise`: C2C's gate, Interlat's dropout), drawn
        from the run's key and the updates done; None for a kind without."""
        if self.kind.noise is None:
            return None
        step = optax.tree_utils.tree_get_all_with_path(state["opt_state"], "count")[0][1]  # the updates done
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
        return self.kind.noise(key, step, self.total_steps, micro_batches)

    def _train_step(self, state, llm_states, batches):
        def micro(grads, xs):
            batch, noise = xs
            (_, metrics), g = jax.value_and_grad(self._loss(state["params"], llm_states, batch, noise), has_aux=True)(
                state["params"]
            )
            return jax.tree.map(jnp.add, grads, g), metrics

        zeros = jax.tree.map(jnp.zeros_like, state["params"])
        noises = self._noise(state, batches.context.shape[0])
        grads, metrics = jax.lax.scan(micro, zeros, (batches, noises))
        grads = jax.tree.map(lambda g: g / batches.context.shape[0], grads)
        metrics = jax.tree.map(jnp.mean, metrics) | dict(grad_norm=optax.global_norm(grads))
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        state = dict(state, params=optax.apply_updates(state["params"], updates), opt_state=opt_state)
        return state, metrics | dict(state_finite=checkpoint.finite(state))

    def _eval_step(self, params, llm_states, batch):
        return self._loss(params, llm_states, batch, prompt=True)(params)[1]  # the CE too, whatever the loss

    def _baseline_step(self, params, llm_states, batch):
        """Prompt CE with no context, the native context cache, and the translated cache."""
        _, _, target = self._models(params, llm_states)
        batch_size, context_length = batch.context.shape
        capacity = context_length + batch.prompt.shape[1]
        context = Forward(batch.context, batch.context_mask, fresh=True)
        native = target.run_layers(context, target.init_cache(batch_size, capacity)).cache
        return dict(
            no_context=objective.prompt_cross_entropy(target, None, batch),
            native=objective.prompt_cross_entropy(target, native, batch),
            translated=self._eval_step(params, llm_states, batch)["ce"],
        )

    def _skip_sums_step(self, params, llm_states, batch):
        translator, source, target = self._models(params, llm_states)
        source_cache, _, native = objective.frozen_forwards(source, target, batch, topk=0, run_source=self.runs_source)
        return linear_skip_sums(
            translator, source, target, source_cache, batch.alignment, native, batch.context_mask, batch.context
        )

    # -- host side --
    def place(self, batch, micro: bool):
        """This process's rows of a numpy batch (all rows in a single process) -> global device arrays, the batch
        axis (1 for stacked micro-batches, else 0) over `data`; JAX infers the global batch from the mesh. Arrays
        already placed (`placed_steps`) pass through."""
        lead = (None,) if micro else ()

        def put(x):
            if isinstance(x, jax.Array):
                return x
            rows = NamedSharding(self.mesh, PartitionSpec(*lead, "data", *([None] * (x.ndim - len(lead) - 1))))
            if isinstance(x, jax.ShapeDtypeStruct):  # an abstract batch (`abstract_batch`): its global shape
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows)
            return jax.make_array_from_process_local_data(rows, x)

        return jax.tree.map(put, batch)

    def placed_steps(self, stream, start: int, count: int):
        """Steps [start, start + count)'s stacked micro-batches (`stream.batch(position)`), each prepared and placed on
        the devices on a background thread while the device computes the steps before it."""
        accum = self.config.grad_accum
        step = lambda i: self.place(stack([stream.batch(i * accum + j) for j in range(accum)]), micro=True)
        return data.prefetch(types.SimpleNamespace(batch=step), start, count)

    def trace_train_step(self, batches):
        """The jitted train step traced on stacked micro-batches (`stack`), to lower and compile it by hand: the
        benchmark's FLOP count and memory plan. Calling the compiled step donates `self.state`."""
        return self._train.trace(self.state, self.llm_states, self.place(batches, micro=True))

    def train_step(self, batches):
        self.state, metrics = self._train(self.state, self.llm_states, self.place(batches, micro=True))
        return metrics

    def steps_done(self) -> int | None:
        """The updates the state holds (None when a step was interrupted after the state was handed to it)."""
        count = optax.tree_utils.tree_get_all_with_path(self.state["opt_state"], "count")[0][1]
        return None if count.is_deleted() else int(count)

    def evaluate(self, batches, fn=None, progress: str | None = None) -> dict:
        """The mean of each metric over `batches`; with `progress`, a meter of that name (minutes-long passes)."""
        fn = fn or self._eval
        batches = metered(batches, progress) if progress else batches
        results = [fn(self.state["params"], self.llm_states, self.place(b, micro=False)) for b in batches]
        return {k: float(np.mean([r[k] for r in results])) for k in results[0]} if results else {}

    def baselines(self, batches, progress: str | None = None) -> dict:
        """Prompt CE over `batches` with no context, native, translated and (for a translator that reads the
        source, and at least two rows) translated from a shuffled source (`shuffled_source`)."""
        results = self.evaluate(batches, self._baselines, progress)
        shuffled = shuffled_source(batches) if self.reads_source else None
        if shuffled:  # the validation program: nothing new compiles
            results["shuffled"] = self.evaluate(shuffled, progress=progress and f"{progress}, shuffled source")["ce"]
        return results

    def skip_statistics(self, batches) -> dict:
        """The least-squares start's statistics (`linear_skip_sums`) added up over `batches`, in float64 on the host."""
        totals = None  # added up batch by batch, in place: one batch's products can take hundreds of MB
        for b in batches:
            part = jax.device_get(self._skip_sums(self.state["params"], self.llm_states, self.place(b, micro=False)))
            if totals is None:
                totals = jax.tree.map(lambda a: np.asarray(a, np.float64), part)
            else:
                add_into(totals, part)
        return totals

    def fit_linear_skip(self, batches, held_out=()) -> dict:
        """Set the K and V linear skips to the least-squares fit of the native K/V left over by the (untrained)
        mixtures on `batches`. With `held_out` batches, each window layer's ridge is the one of
        translator.skip_ridge x `RIDGE_GRID` that leaves the least error on them, and the fit then uses them too.
        Returns per "key"/"value" the residual MSE `before` and `after` the fit on the fitted batches, each layer's
        `ridge` and (with held-out batches) the `held_out` error [G, W] of each ridge of the grid, before the refit."""
        totals = self.skip_statistics(batches)
        held = self.skip_statistics(held_out)
        ridge = self.config.translator.skip_ridge
        translator = nnx.merge(self.graphdef, self.state["params"])
        results = {}
        for name in ("key", "value"):
            result = results[name] = dict(ridge=np.full(totals[name]["rr"].shape, ridge), held_out=None)
            if held:  # each ridge's held-out error [G, W], G = RIDGE_GRID's ridges
                result["ridge"], result["held_out"] = choose_ridge(totals[name], held[name], ridge * RIDGE_GRID)
                add_into(totals[name], held[name])
            kernel, bias, result["before"], result["after"] = solve_linear_skip(totals[name], result["ridge"])
            skip = getattr(translator, f"{name}_skip")
            for var, value in ((skip.kernel, kernel), (skip.bias, bias)):
                var.set_value(jax.device_put(value.astype(var.dtype), var[...].sharding))
        self.state["params"] = nnx.state(translator, nnx.Param)
        return results


def shapes_of(model):
    """`model` with its weights' shapes and dtypes in place of their arrays: its config and structure, no memory."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))


class on_mesh:  # noqa: N801 (a function wrapper, named as one)
    """A jitted function traced and called under `jax.set_mesh(mesh)`: the model's attention entry reads the mesh
    (its platform, and the axes to run a kernel on each chip's shard by `shard_map`); `trace` likewise."""

    def __init__(self, mesh, jitted):
        self.mesh, self.jitted = mesh, jitted

    def __call__(self, *args):
        with jax.set_mesh(self.mesh):
            return self.jitted(*args)

    def trace(self, *args):
        with jax.set_mesh(self.mesh):
            return self.jitted.trace(*args)


def abstract_batch(config, micro_batches: int | None = None):
    """The shapes of the config's training batch (`data.make_batch`), as ShapeDtypeStructs; with `micro_batches`,
    that many stacked (`stack`), as a train step takes them."""
    d, rows = config.data, config.batch_size
    lead = () if micro_batches is None else (micro_batches,)
    tc, tp, s = d.prefix_tokens - 1, d.total_tokens - d.prefix_tokens, d.source_length
    shaped = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct((*lead, rows, *shape), dtype)
    alignment = data.Alignment(shaped(tc, s, dtype=jnp.float32), shaped(tc), shaped(s))
    return data.Batch(
        shaped(tc),
        shaped(tc, dtype=bool),
        shaped(tp),
        shaped(tp),
        shaped(tp, dtype=bool),
        shaped(s),
        shaped(s, dtype=bool),
        alignment,
    )


def add_into(totals, part):
    """Add the arrays of `part` into those of `totals` (the same tree), in place."""
    jax.tree.map(lambda total, a: np.add(total, a, out=total), totals, part)


def shuffled_source(batches: list) -> list | None:
    """`batches` with each row's source side (source ids, mask, alignment) taken from another row, the evaluation's
    shuffled-source control (evals.methods.ShuffledSource): the donor is the next row, cyclically over all the
    batches' rows (so a batch of one row has one), whose context differs, and its alignment is regridded onto this
    row's target grid. The translation then carries none of the row's context. None (logged) when the rows hold
    fewer than two contexts."""
    rows = jax.tree.map(lambda *x: np.concatenate(x), *batches)
    try:
        donors = np.array(
            donor_indices([dict(context=c[m].tobytes()) for c, m in zip(rows.context, rows.context_mask)])
        )
    except MotJaxError:
        logging.warning("The held-out rows hold one context: no shuffled-source row; raise final_eval_batches.")
        return None
    out, start = [], 0
    for b in batches:
        picked = donors[start : start + len(b.context)]
        start += len(b.context)
        donor = jax.tree.map(lambda x, picked=picked: x[picked], rows)
        alignment = regrid(donor.alignment, donor.context_mask, b.context_mask, donor.source_mask)
        out.append(
            dataclasses.replace(b, source_ids=donor.source_ids, source_mask=donor.source_mask, alignment=alignment)
        )
    return out


def stack(batches: list) -> dict:
    return jax.tree.map(lambda *x: np.stack(x), *batches)


class NonFinite(MotJaxError):
    def __init__(self, step, what):
        super().__init__(f"{what} at step {step}")
        self.step = step


def fit(trainer: Trainer, stream, start: int, steps: int, on_step=None, read_at=None, stop=None) -> int:
    """Run steps [start, steps) on micro-batches `stream.batch(position)`, each step's prepared and placed on the
    devices on a background thread while the device computes the steps before it. The steps are dispatched back to
    back: their metrics (the loss, and whether the updated state is finite, computed on the device) are read back
    only every `config.log_every` steps, at the last step and at each step `read_at(step)` names (where the caller
    validates or saves); `on_step(step, metrics, seconds)` then runs for each step read back, `seconds` the steps'
    mean. Raises NonFinite naming the first step whose loss or updated state is not finite. `stop(step)`, asked
    after each step is dispatched, stops the run after that step (read back and checked); returns the last step."""
    every = trainer.config.log_every
    placed = trainer.placed_steps(stream, start, steps - start)
    pending, began = [], time.perf_counter()  # the steps dispatched since the last read-back: their device metrics
    try:
        for step in range(start + 1, steps + 1):
            pending.append(trainer.train_step(next(placed)))
            stopping = bool(stop and stop(step))
            if step % every == 0 or step == steps or stopping or (read_at and read_at(step)):
                seconds = (time.perf_counter() - began) / len(pending)
                for done, metrics in enumerate(jax.device_get(pending), step - len(pending) + 1):
                    if not math.isfinite(metrics["loss"]):
                        raise NonFinite(done, f"The loss became {float(metrics['loss'])}")
                    if not metrics.pop("state_finite"):
                        raise NonFinite(done, "The parameters or optimizer state became non-finite")
                    if on_step:
                        on_step(done, metrics, seconds)
                pending, began = [], time.perf_counter()
            if stopping:
                return step
    finally:
        placed.close()
    return steps


def start_linear_skip(trainer: Trainer, stream, num_batches: int, held_out: int = 0):
    """The least-squares start of the linear skips, on the first `num_batches` training batches, the last `held_out`
    of them first held out to choose each layer's ridge (logged)."""
    if num_batches < 1:
        raise MotJaxError(
            f"translator.skip_fit_batches={num_batches} leaves nothing to fit the linear skip on; pass at least 1."
        )
    began = time.perf_counter()
    batches = metered(
        (stream.batch(i) for i in range(num_batches)), "Least-squares fit of the linear skip", total=num_batches
    )
    results = trainer.fit_linear_skip(itertools.islice(batches, num_batches - held_out), batches)
    logging.info(
        "Linear skip fitted by least squares on %d batches in %.0f s: mean squared error of K %.4f -> %.4f, V %.4f -> "
        "%.4f",
        num_batches,
        time.perf_counter() - began,
        *(results[name][when] for name in ("key", "value") for when in ("before", "after")),
    )
    for name, result in results.items():
        if result["held_out"] is not None:
            errors = result["held_out"]
            logging.info(
                "%s ridge per layer (x the mean input variance), chosen on %d held-out batches: %s; held-out mean "
                "squared error %.4f at translator.skip_ridge, %.4f at the chosen ridges",
                name,
                held_out,
                " ".join(f"{r:g}" for r in result["ridge"]),
                errors[0].mean(),
                errors.min(0).mean(),
            )


def count_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
