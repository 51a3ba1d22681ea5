"""`train_and_evaluate(config, workdir)`: the training run behind `python -m mot_jax.train`.

Frozen source and target LLMs (replicated, or FSDP-split over `data`), translator experts sharded over the
`expert` mesh axis, batches over `data`; one jitted step does the frozen forwards, the Context Correction loss and
its gradient for every micro-batch (a scan: gradient accumulation) and one AdamW update. The run resumes from the
workdir's latest checkpoint, holds a lock on the workdir for its whole life, stops on a non-finite loss or state, a
failed save or Ctrl-C in one line (keeping the last good checkpoint: a checkpoint is only saved once a forward on it
gave a finite loss), and ends with a short held-out comparison of the translated cache against no context and the
native context.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mot_jax import multihost, sharding
from mot_jax.errors import MotJaxError
from mot_jax.locks import file_lock
from mot_jax.models.loading import load_model, load_tokenizer
from mot_jax.models.registry import resolve_dtype
from mot_jax.paths import as_path, cache_root
from mot_jax.training import config as config_lib
from mot_jax.training import corpus, data, objective
from mot_jax.training.checkpoint import Checkpoints
from mot_jax.training.optim import adamw
from mot_jax.translate import channels
from mot_jax.translate.expert import TranslatorConfig
from mot_jax.translate.translator import (
    KVTranslator,
    TranslationSpec,
    linear_skip_sums,
    mixture_config,
    solve_linear_skip,
)

TRANSLATOR_KEYS = [f.name for f in dataclasses.fields(TranslatorConfig)]


@dataclasses.dataclass
class Pair:
    source: object
    target: object
    source_tokenizer: object
    target_tokenizer: object


def load_pair(config) -> Pair:
    logging.info("Loading source %s and target %s (%s)", config.source, config.target, config.dtype)
    source, target = (load_model(name, config.dtype)[0] for name in (config.source, config.target))
    return Pair(source, target, load_tokenizer(config.source), load_tokenizer(config.target))


@dataclasses.dataclass
class Datasets:
    train: data.Batches  # the shuffled infinite stream; `batch(position)`
    validation: list  # fixed batches: the first `eval_batches` score checkpoints, the next ones are held out


def make_datasets(config, pair: Pair, rows: slice = slice(None)) -> Datasets:
    """`rows`: the rows of each global batch this process builds (multihost.local_rows; all of them by default)."""
    d = config.data
    documents = corpus.documents(d.corpus, d.data_dir or None)
    eos = pair.target.config.eos_ids
    if not eos:
        raise MotJaxError(f"The target {config.target!r} defines no EOS token id, which separates documents.")
    tokenizers = dict(source_tokenizer=pair.source_tokenizer, target_tokenizer=pair.target_tokenizer)
    lengths = dict(source_length=d.source_length, prefix_tokens=d.prefix_tokens)

    def chunks(split):
        return data.TextChunks(
            documents[split], pair.target_tokenizer, eos_id=eos[0], total_tokens=d.total_tokens, **lengths,
            source_tokenizer=pair.source_tokenizer,
        )  # fmt: skip

    needed = max(config.eval_batches, config.translator.channels.search_eval_batches) + config.final_eval_batches
    return Datasets(
        data.Batches(
            chunks("train"),
            config.batch_size,
            config.seed,
            **tokenizers,
            **lengths,
            rows=rows,
            copy_fraction=config.data.copy_fraction,
        ),  # fmt: skip
        data.validation_batches(
            chunks("validation"), config.batch_size, **tokenizers, **lengths, max_batches=needed, rows=rows
        ),
    )


def make_mesh(config) -> jax.sharding.Mesh:
    data_axis, expert_axis = config.mesh.data, config.mesh.expert
    devices = jax.devices() if data_axis == -1 else jax.devices()[: data_axis * expert_axis]
    if jax.process_count() > 1 and len(devices) != jax.device_count():
        raise MotJaxError(
            f"A run of {jax.process_count()} processes uses all {jax.device_count()} devices; set "
            "--config.mesh.data=-1 (or data x expert to the device count)."
        )
    mesh = sharding.make_mesh(data_axis, expert_axis, devices)
    if config.batch_size % mesh.shape["data"]:
        raise MotJaxError(
            f"batch_size={config.batch_size} is not divisible by the mesh's data axis ({mesh.shape['data']} devices); "
            "set --config.batch_size to a multiple of it or --config.mesh.data to a divisor of it."
        )
    return mesh


def translation(config, channel_map, pair: Pair, **overrides):
    t = config.translator
    num_target_layers = pair.target.config.num_layers
    if t.native_bottom >= num_target_layers:
        raise MotJaxError(
            f"native_bottom={t.native_bottom} leaves none of the target's {num_target_layers} layers to translate "
            "(that is native context); pass a smaller --config.translator.native_bottom."
        )
    spec = TranslationSpec.build(
        t.mode, channel_map, pair.source.config.num_layers, num_target_layers, native_bottom=t.native_bottom,
        inputs=tuple(i.strip() for i in t.inputs.split(",") if i.strip()), sparse_attention=t.sparse_attention,
        k_attn=t.k_attn, dense_bottom=t.dense_bottom, rotary=t.rotary,
    )  # fmt: skip
    kwargs = {k: t[k] for k in TRANSLATOR_KEYS if k in t} | overrides
    return spec, mixture_config(spec, pair.source, pair.target, **kwargs)


def identity(config, spec: TranslationSpec, tcfg: TranslatorConfig, pair: Pair) -> dict:
    """What a checkpoint must match to be resumed: the model pair and the translator's shape and wiring."""
    return json.loads(
        json.dumps(
            dict(
                source=config.source,
                target=config.target,
                source_model=dataclasses.asdict(pair.source.config),
                target_model=dataclasses.asdict(pair.target.config),
                translator=tcfg.to_dict(),
                spec=spec.to_dict(),
            ),
            default=str,
        )
    )


class Trainer:
    """The jitted train and eval steps of one translator shape over a mesh, and the state they update."""

    def __init__(self, config, pair: Pair, spec, tcfg, mesh, total_steps: int):
        self.config, self.pair, self.mesh = config, pair, mesh
        rules = sharding.FSDP_RULES if config.mesh.fsdp else sharding.RULES
        for model in (pair.source, pair.target):
            sharding.shard(model, mesh, rules)
        translator = KVTranslator(spec, tcfg, rngs=nnx.Rngs(config.seed))
        sharding.shard(translator, mesh)
        self.graphdef, params = nnx.split(translator, nnx.Param)
        self.llm_graphs, self.llm_states = zip(*(nnx.split(m) for m in (pair.source, pair.target)))
        self.tx, self.schedule = adamw(config.optim, total_steps)
        rng = jax.random.key_data(jax.random.key(config.seed))
        self.state = dict(params=params, opt_state=jax.jit(self.tx.init)(params), rng=rng)
        self.topk = spec.attention_topk
        self.compute_dtype = resolve_dtype(config.dtype)
        self.weights = objective.LossWeights.from_config(config.loss)
        replicated = NamedSharding(mesh, PartitionSpec())
        named = lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated
        state_sharding = jax.tree.map(named, self.state)  # fixed, so the step compiles once
        self.state = jax.device_put(self.state, state_sharding)
        self._train = jax.jit(self._train_step, donate_argnums=(0,), out_shardings=(state_sharding, None))
        self._eval = jax.jit(self._eval_step)
        self._baselines = jax.jit(self._baseline_step)
        self._skip_sums = jax.jit(self._skip_sums_step)

    # -- pure functions (traced) --
    def _models(self, params, llm_states):
        params = jax.tree.map(lambda p: p.astype(self.compute_dtype), params)
        translator = nnx.merge(self.graphdef, params)
        source, target = (nnx.merge(g, s) for g, s in zip(self.llm_graphs, llm_states))
        return translator, source, target

    def _loss(self, params, llm_states, batch):
        _, source, target = self._models(params, llm_states)
        frozen = objective.frozen_forwards(source, target, batch, self.topk)

        def loss_fn(p):
            translator, _, _ = self._models(p, llm_states)
            return objective.context_correction(translator, source, target, batch, frozen, self.weights)

        return loss_fn

    def _train_step(self, state, llm_states, batches):
        def micro(grads, batch):
            (_, metrics), g = jax.value_and_grad(self._loss(state["params"], llm_states, batch), has_aux=True)(
                state["params"]
            )
            return jax.tree.map(jnp.add, grads, g), metrics

        zeros = jax.tree.map(jnp.zeros_like, state["params"])
        grads, metrics = jax.lax.scan(micro, zeros, batches)
        grads = jax.tree.map(lambda g: g / batches.context.shape[0], grads)
        metrics = jax.tree.map(jnp.mean, metrics) | dict(grad_norm=optax.global_norm(grads))
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        state = dict(state, params=optax.apply_updates(state["params"], updates), opt_state=opt_state)
        floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
        return state, metrics | dict(state_finite=jnp.all(jnp.stack([jnp.isfinite(x).all() for x in floats])))

    def _eval_step(self, params, llm_states, batch):
        return self._loss(params, llm_states, batch)(params)[1]

    def _baseline_step(self, params, llm_states, batch):
        """Prompt CE with no context, the native context cache, and the translated cache."""
        _, _, target = self._models(params, llm_states)
        batch_size, context_length = batch.context.shape
        capacity = context_length + batch.prompt.shape[1]
        _, native, _ = target.run_layers(
            batch.context, batch.context_mask, cache=target.init_cache(batch_size, capacity), fresh=True
        )
        return dict(
            no_context=objective.prompt_cross_entropy(target, None, batch),
            native=objective.prompt_cross_entropy(target, native, batch),
            translated=self._eval_step(params, llm_states, batch)["ce"],
        )

    def _skip_sums_step(self, params, llm_states, batch):
        translator, source, target = self._models(params, llm_states)
        source_cache, _, native = objective.frozen_forwards(source, target, batch, topk=0)
        return linear_skip_sums(translator, source, target, source_cache, batch.alignment, native, batch.context_mask,
                                batch.context)  # fmt: skip

    # -- host side --
    def place(self, batch, micro: bool):
        """This process's rows of a numpy batch (all rows in a single process) -> global device arrays, the batch
        axis (1 for stacked micro-batches, else 0) over `data`; JAX infers the global batch from the mesh."""
        lead = (None,) if micro else ()
        put = lambda x: jax.make_array_from_process_local_data(
            NamedSharding(self.mesh, PartitionSpec(*lead, "data", *([None] * (x.ndim - len(lead) - 1)))), x
        )
        return jax.tree.map(put, batch)

    def train_step(self, batches):
        self.state, metrics = self._train(self.state, self.llm_states, self.place(batches, micro=True))
        return metrics

    def evaluate(self, batches, fn=None) -> dict:
        fn = fn or self._eval
        results = [fn(self.state["params"], self.llm_states, self.place(b, micro=False)) for b in batches]
        return {k: float(np.mean([r[k] for r in results])) for k in results[0]} if results else {}

    def baselines(self, batches) -> dict:
        return self.evaluate(batches, self._baselines)

    def fit_linear_skip(self, batches) -> dict:
        """Set the K and V linear skips to the least-squares fit of the native K/V left over by the (untrained)
        mixtures on `batches`; returns {"key"/"value": (residual MSE before, after)} on those batches."""
        totals = None  # added up batch by batch: one batch's products can take hundreds of MB
        for b in batches:
            part = jax.device_get(self._skip_sums(self.state["params"], self.llm_states, self.place(b, micro=False)))
            part = jax.tree.map(lambda a: np.asarray(a, np.float64), part)
            totals = part if totals is None else jax.tree.map(np.add, totals, part)
        translator = nnx.merge(self.graphdef, self.state["params"])
        errors = {}
        for name in ("key", "value"):
            kernel, bias, *errors[name] = solve_linear_skip(totals[name])
            skip = getattr(translator, f"{name}_skip")
            for var, value in ((skip.kernel, kernel), (skip.bias, bias)):
                var.set_value(jax.device_put(value.astype(var.dtype), var[...].sharding))
        self.state["params"] = nnx.state(translator, nnx.Param)
        return errors


def stack(batches: list) -> dict:
    return jax.tree.map(lambda *x: np.stack(x), *batches)


def fit(trainer: Trainer, stream, start: int, steps: int, on_step=None):
    """Run steps [start, steps) with micro-batches `stream.batch(position)` (prepared on a background thread while
    the device computes); `on_step(step, metrics, seconds)` after each. Raises NonFinite, naming the step, on a
    non-finite loss or a non-finite state after the update."""
    accum = trainer.config.grad_accum
    micro_batches = data.prefetch(stream, start * accum, (steps - start) * accum)
    try:
        for step in range(start, steps):
            began = time.perf_counter()
            metrics = jax.device_get(trainer.train_step(stack([next(micro_batches) for _ in range(accum)])))
            if not math.isfinite(float(metrics["loss"])):
                raise NonFinite(step + 1, f"The loss became {float(metrics['loss'])}")
            if not metrics.pop("state_finite"):
                raise NonFinite(step + 1, "The parameters or optimizer state became non-finite")
            if on_step:
                on_step(step + 1, metrics, time.perf_counter() - began)
    finally:
        micro_batches.close()


class NonFinite(MotJaxError):
    def __init__(self, step, what):
        super().__init__(f"{what} at step {step}")
        self.step = step


class Interrupted(MotJaxError):
    exit_status = 130  # the shell's status for Ctrl-C


def workdir_lock(workdir: epath.Path):
    """One run per workdir, for the run's whole life: each process of a run takes its own lock file there (process
    0 `.lock`, process i `.lock.i`), so every process of a second run is refused at once, before any of them waits
    for the others in a collective, while the processes of one run never block each other. A gs:// workdir, or a
    file system without flock, runs unlocked."""
    stack = contextlib.ExitStack()
    if "://" not in str(workdir):
        i = jax.process_index()
        path = Path(workdir) / (".lock" if i == 0 else f".lock.{i}")
        busy = f"Another training run is using {workdir}; wait for it to end, or pass a new --workdir."
        try:
            stack.enter_context(file_lock(path, busy=busy))
        except OSError as e:
            logging.warning("No lock on %s (%s): nothing stops a second run there.", workdir, e)
    return stack


def search_channels(config, pair: Pair, datasets, mesh, workdir: epath.Path) -> channels.ChannelMap:
    """The depth-ratio proxy search: every candidate window trains a single translator with the training step for
    `search_steps` and is scored by its validation loss; the scores go to workdir/channel_search.json."""
    c = config.translator.channels
    steps = c.search_steps
    search_config = ml_collections.ConfigDict(config.to_dict())
    search_config.optim.warmup_steps = min(config.optim.warmup_steps, max(steps // 4, 1))
    results = []

    def score(channel_map):
        spec, tcfg = translation(search_config, channel_map, pair, num_experts=1, top_k=1)
        trainer = Trainer(search_config, pair, spec, tcfg, mesh, steps)
        fit(trainer, datasets.train, 0, steps)
        loss = trainer.evaluate(datasets.validation[: c.search_eval_batches])["loss"]
        logging.info("channel search: source %s -> target %s: validation loss %.4f", channel_map.source,
                     channel_map.target, loss)  # fmt: skip
        results.append(dict(source=list(channel_map.source), target=list(channel_map.target), loss=loss))
        return loss

    chosen = channels.resolve(
        pair.source.config.num_layers, pair.target.config.num_layers, "depth_ratio", min_ratio=c.min_ratio,
        max_ratio=c.max_ratio, score=score, grow_only_if_better=c.grow_only_if_better,
    )  # fmt: skip
    if jax.process_index() == 0:
        record = dict(scores=results, chosen=json.loads(chosen.to_json()), steps_per_window=steps)
        (workdir / "channel_search.json").write_text(json.dumps(record, indent=2))
    return chosen


def resolve_channels(config, pair, datasets, mesh, workdir) -> channels.ChannelMap:
    c = config.translator.channels
    source_layers, target_layers = pair.source.config.num_layers, pair.target.config.num_layers
    if config.translator.mode == "direct":
        return channels.terminal(source_layers, target_layers, 1.0)  # unused: direct writes every target layer
    mode = str(c.mode).replace("-", "_")
    if mode == "depth_ratio":
        return search_channels(config, pair, datasets, mesh, workdir)
    return channels.resolve(
        source_layers, target_layers, mode, ratio=c.ratio, source_layers=list(c.source_layers) or None,
        target_layers=list(c.target_layers) or None,
    )  # fmt: skip


def check_identity(saved: dict, current: dict, workdir: epath.Path):
    saved = saved | {
        "translator": TranslatorConfig.with_added_fields(saved.get("translator", {})),
        "spec": TranslationSpec.with_added_fields(saved.get("spec", {})),
    }
    differ = sorted(k for k in current if saved.get(k) != current[k])
    if differ:
        raise MotJaxError(
            f"{workdir} holds a run of another experiment (it differs in: {', '.join(differ)}); pass a new --workdir, "
            "or the config that made it."
        )


class Logger:
    """absl logs (with tokens/s and ETA), TensorBoard event files (tensorboardX, no TensorFlow) and, on a terminal,
    a progress bar; process 0 only."""

    def __init__(self, workdir: epath.Path, total: int, start: int, tokens_per_step: int, log_every: int):
        self.main = jax.process_index() == 0
        self.tokens_per_step, self.log_every, self.total, self.start = tokens_per_step, log_every, total, start
        self.began = time.perf_counter()
        self.writer = self.bar = None
        if self.main:
            from tensorboardX import SummaryWriter
            from tqdm import tqdm

            self.writer = SummaryWriter(str(workdir / "tensorboard"))
            self.bar = tqdm(
                total=total, initial=start, unit="step", dynamic_ncols=True, disable=not sys.stderr.isatty()
            )

    def scalars(self, step: int, values: dict, prefix: str):
        if self.main:
            for k, v in values.items():
                self.writer.add_scalar(f"{prefix}/{k}", float(v), step)

    def step(self, step: int, metrics: dict, seconds: float, learning_rate: float):
        if not self.main:
            return
        tokens_per_second = self.tokens_per_step / max(seconds, 1e-9)
        values = {k: float(v) for k, v in metrics.items()} | dict(learning_rate=learning_rate)
        self.scalars(step, values | dict(tokens_per_second=tokens_per_second), "train")
        self.bar.set_postfix(loss=f"{values['loss']:.3f}", ce=f"{values['ce']:.3f}", tok_s=f"{tokens_per_second:.0f}")
        self.bar.update(1)
        if step % self.log_every == 0:
            shown = " ".join(f"{k}={v:.4g}" for k, v in values.items())
            eta = (time.perf_counter() - self.began) / (step - self.start) * (self.total - step)
            logging.info("step %d/%d: %s tokens/s=%.0f eta=%.0fs", step, self.total, shown, tokens_per_second, eta)

    def close(self):
        if self.main:
            self.bar.close()
            self.writer.close()


def evaluation_table(results: dict) -> str:
    rows = [
        ("no context", results["no_context"]),
        ("native context", results["native"]),
        ("translated (untrained)", results.get("untrained")),
        ("translated (trained)", results["translated"]),
    ]
    lines = ["| method | prompt CE | perplexity |", "|---|---|---|"]
    lines += [f"| {name} | {ce:.4f} | {math.exp(min(ce, 50)):.2f} |" for name, ce in rows if ce is not None]
    return "\n".join(lines)


def train_and_evaluate(config, workdir) -> dict:
    """Train (or resume) the config's translator in `workdir`; returns the final summary."""
    config_lib.check(config)
    mesh = make_mesh(config)
    workdir = as_path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with workdir_lock(workdir):
        multihost.check_shared(workdir)
        with multihost.prepare_lock(cache_root()):  # processes on one host: the first builds caches, the others read
            pair = load_pair(config)
            datasets = make_datasets(config, pair, multihost.local_rows(mesh, config.batch_size))
        checkpoints = Checkpoints(workdir, config.keep_checkpoints)
        try:
            return train_in(workdir, config, mesh, pair, datasets, checkpoints)
        finally:
            checkpoints.close()  # waits for the last save and stops Orbax's threads on every way out


def train_in(workdir, config, mesh, pair: Pair, datasets: Datasets, checkpoints: Checkpoints) -> dict:
    """train_and_evaluate once the workdir is locked and the models and data are loaded."""
    start = checkpoints.latest_step() or 0
    if config.steps < start:
        raise MotJaxError(
            f"{workdir} is at step {start}, past --config.steps={config.steps}; pass --config.steps above {start} "
            "to train on, or a new --workdir."
        )
    meta = checkpoints.read_meta(start) if start else {}
    if start:
        channel_map = channels.ChannelMap.from_json(meta["channel_map"])
    else:
        channel_map = resolve_channels(config, pair, datasets, mesh, workdir)
    spec, tcfg = translation(config, channel_map, pair)
    current = identity(config, spec, tcfg, pair)
    if start:
        check_identity(meta["identity"], current, workdir)
    trainer = Trainer(config, pair, spec, tcfg, mesh, config.steps)
    validation = datasets.validation[: config.eval_batches]
    held_out = datasets.validation[config.eval_batches :][: config.final_eval_batches] or validation
    if start:
        trainer.state = checkpoints.restore(trainer.state, start)
        logging.info("Resumed from step %d in %s", start, workdir)
        initial, best = meta["initial_validation"], meta["best_validation_loss"]
    else:
        if tcfg.linear_skip:
            start_linear_skip(trainer, datasets.train, config.translator.skip_fit_batches)
        initial = trainer.evaluate(validation) | dict(held_out_ce=trainer.evaluate(held_out)["ce"])
        best = math.inf
        if jax.process_index() == 0:
            (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    logging.info("Translator: %d parameters; channel map %s", count_params(trainer.state["params"]), channel_map)
    accum = config.grad_accum
    tokens_per_step = config.batch_size * accum * config.data.total_tokens
    began, last_saved, last_validation, done = time.perf_counter(), start, None, start

    def meta_at(step):
        return dict(
            step=step, data_position=step * accum, channel_map=channel_map.to_json(), identity=current,
            config=config.to_json_best_effort(), initial_validation=initial, best_validation_loss=best,
        )  # fmt: skip

    def on_step(step, metrics, seconds):
        nonlocal best, last_saved, last_validation, done
        done = step
        logger.step(step, metrics, seconds, float(trainer.schedule(step - 1)))
        checkpoints.check()  # a background save that failed stops the run at once
        last = step == config.steps
        val, improved = None, False
        if step % config.eval_every == 0 or last:
            val = trainer.evaluate(validation)
            logger.scalars(step, val, "validation")
            logging.info("step %d: validation loss %.4f (ce %.4f)", step, val["loss"], val["ce"])
            improved, best, last_validation = val["loss"] < best, min(best, val["loss"]), val
        if step % config.checkpoint_every == 0 or last:
            # this step's training loss came from the state before its update: check the state to be saved itself
            loss = (val or trainer.evaluate(validation[:1]))["loss"]
            if not math.isfinite(loss):
                raise NonFinite(step, f"The validation loss became {loss} after the update")
            checkpoints.save(step, trainer.state, meta_at(step), best=improved)
            last_saved = step

    logger = Logger(workdir, config.steps, start, tokens_per_step, config.log_every)
    try:
        fit(trainer, datasets.train, start, config.steps, on_step)
    except NonFinite as e:
        kept = f"the last good checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
        raise MotJaxError(
            f"{e} (non-finite); stopped, {kept} in {workdir}; lower --config.optim.learning_rate or use float32."
        ) from None
    except KeyboardInterrupt:
        kept = f"the last checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
        message = f"interrupted after step {done}; {kept} in {workdir}; run the same command to resume."
        raise Interrupted(message) from None
    finally:
        logger.close()
    results = trainer.baselines(held_out) | dict(untrained=initial["held_out_ce"])
    summary = dict(
        steps=config.steps,
        seconds=round(time.perf_counter() - began, 1),
        final_validation=last_validation or trainer.evaluate(validation),  # the last step is always validated
        initial_validation=initial,
        held_out=results,
        channel_map=json.loads(channel_map.to_json()),
    )
    if jax.process_index() == 0:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(evaluation_table(results))
        print(
            f"done: {config.steps} steps ({config.steps - start} this run) in {summary['seconds']:.0f} s; validation "
            f"loss {summary['final_validation']['loss']:.4f} (untrained {initial['loss']:.4f}); prompt CE "
            f"translated {results['translated']:.4f}, native {results['native']:.4f}, no context "
            f"{results['no_context']:.4f}; checkpoints in {workdir / 'checkpoints'}"
        )
    return summary


def start_linear_skip(trainer: Trainer, stream, num_batches: int):
    """The least-squares start of the linear skips, on the first `num_batches` training batches (logged)."""
    if num_batches < 1:
        raise MotJaxError(
            f"translator.skip_fit_batches={num_batches} leaves nothing to fit the linear skip on; pass at least 1."
        )
    began = time.perf_counter()
    errors = trainer.fit_linear_skip([stream.batch(i) for i in range(num_batches)])
    logging.info(
        "Linear skip fitted by least squares on %d batches in %.0f s: mean squared error of K %.4f -> %.4f, V %.4f -> "
        "%.4f", num_batches, time.perf_counter() - began, *errors["key"], *errors["value"],
    )  # fmt: skip


def count_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
