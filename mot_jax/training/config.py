"""The training config: every key with its default (the paper's recipe), and the `:tiny` shrink.

Experiment files in `configs/` start from `base()` and change what differs; `python -m mot_jax.train` locks the
config, so a misspelt `--config.key=value` fails instead of being ignored.
"""

from __future__ import annotations

import json
import math

import ml_collections

from mot_jax.errors import MotJaxError
from mot_jax.files import strict_json
from mot_jax.models.base import REMAT_POLICIES
from mot_jax.translate import kinds


def base() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.source = "gpt2-medium"  # model names: embedded (smollm2-135m), GGUF file, HF dir or hub id, random:FAMILY
    c.target = "gpt2"
    c.dtype = "float32"  # LLM weights and compute: float32 | bfloat16 (translator params and optimizer stay fp32)
    # what the backward pass through the frozen LLMs' layer scans keeps (the rest it recomputes): none (keep all) |
    # dots (the projections' outputs, not attention's scores: a large target at long contexts) | nothing
    c.remat = "none"
    c.seed = 42

    c.data = ml_collections.ConfigDict()
    c.data.corpus = "docs_prose"  # docs_prose (offline) | a folder or file | tfds:NAME | huggingface:NAME
    c.data.data_dir = ""  # prepared TFDS data and chunk tables; "" = the mot_jax cache
    c.data.total_tokens = 128  # target tokens per chunk: context P-1, prompt (suffix) T-P+1, labels shifted
    c.data.prefix_tokens = 64
    c.data.source_length = 128  # static source context length (chunks whose source text is longer are skipped)
    c.data.copy_fraction = 0.0  # ours: the share of training rows whose prompt repeats a span of their context
    # ours: shares of rows that ask about a span of their context (training/questions.py): span rows from the corpus
    # chunk, fact rows about invented ships; labels on the answer alone
    c.data.question_fraction = 0.0
    c.data.fact_fraction = 0.0
    c.data.train_chunks = 0  # train on the chunk table's first N chunks only (0: all of it)
    # read and tokenize only each split's first N documents (0: all): a large corpus (OpenWebText's 8M) is otherwise
    # tokenized whole before its first step
    c.data.max_documents = 0
    # ours: a KV-space objective (loss.ce_weight=0, no distill) reads the frozen models' outputs per chunk from a
    # cache on disk, computed once, instead of running the frozen forwards every step (training/features.py)
    c.data.feature_cache = False

    c.translator = ml_collections.ConfigDict()
    c.translator.mode = "replay"  # replay (paper) | direct
    c.translator.channels = ml_collections.ConfigDict()
    c.translator.channels.mode = "depth_ratio"  # terminal | depth_ratio | explicit (replay only)
    c.translator.channels.ratio = 0.3  # terminal
    c.translator.channels.min_ratio = 0.3  # depth_ratio: proxy search over windows of these sizes
    c.translator.channels.max_ratio = 0.3
    c.translator.channels.grow_only_if_better = False
    c.translator.channels.source_layers = ()  # explicit
    c.translator.channels.target_layers = ()
    c.translator.channels.search_steps = 128  # proxy training steps per candidate window (N=1 translator)
    c.translator.channels.search_eval_batches = 4
    # a registered kind (`mot_jax/translate/kinds/`, the table in docs/translators.md): mot (the paper's mixture),
    # linear (ours: the least-squares-started linear skip alone), and the baselines projector, c2c, lsc, mot_h and
    # interlat; each kind's own fields follow below, and `kinds.apply_recipe` sets its reference's training settings
    c.translator.kind = "mot"
    c.translator.dim = 1024
    c.translator.heads = 16
    c.translator.depth = 2
    c.translator.mlp_ratio = 4
    c.translator.output_activation = "gelu"  # gelu (paper) | none
    c.translator.fused_output = True
    c.translator.causal = False
    c.translator.rotary = False
    c.translator.num_experts = 2
    c.translator.top_k = 1
    c.translator.dispatch = "sparse"  # sparse (real top-k dispatch) | dense (the reference)
    c.translator.capacity_factor = 1.25
    # ours: beside each mixture a linear map per window layer from the aligned source K (or V) to the target's, added
    # to the mixture's output and set by least squares on the first skip_fit_batches training batches before step 1
    c.translator.linear_skip = False
    # direct (ours): the target's own layers below this run over the context, the translator writes the rest
    c.translator.native_bottom = 0
    # what the translator reads per token, a comma list: source (the aligned source K/V, paper), embeddings (the
    # target's own token embeddings), hidden (its residual stream after the native bottom layers); no source: the
    # source-free control
    c.translator.inputs = "source"
    # what it writes per layer: kv (the K/V, paper) | hidden (ours: layer inputs that the target's own frozen norm,
    # K/V projections, k-norm and RoPE turn into its K/V)
    c.translator.outputs = "kv"
    # ours: the rank of a trained change to the target's query projections in the layers the translator writes, so
    # that the target learns to read the translation (translate/receiver.py); 0: the target stays frozen
    c.translator.receiver_rank = 0
    c.translator.skip_fit_batches = 8
    c.translator.skip_ridge = 1e-3  # the fit's ridge, times the mean input variance (more: less fit to few batches)
    # the last N of the fit batches held out to choose each layer's ridge from skip_ridge x 1, 10, ..., 1e4 by the
    # error it leaves on them (then the fit uses them too); 0: skip_ridge as given
    c.translator.skip_ridge_held_out = 0
    c.translator.sparse_attention = True  # replay: top-k attention from the source's attention (paper)
    c.translator.k_attn = 32
    c.translator.dense_bottom = 2
    c.translator.update(kinds.fields())  # each kind's own fields (`Kind.fields`), at their defaults

    c.loss = ml_collections.ConfigDict()
    c.loss.ce_weight = 1.0  # the prompt CE; 0 with no distill: a KV-space objective, no forward over the prompt
    c.loss.correction_weight = 1.0  # lambda on MSE(K) + MSE(V) against the native prefill
    c.loss.distill_weight = 0.0  # ours: mu on KL(native || translated) over the prompt's next tokens
    c.loss.distill_temperature = 1.0  # the KL's softmax temperature T (SwiftKV: 2), the term scaled by T^2
    # ours: on the final-normed hidden states over the prompt after the translated cache against after the native one,
    # their squared error over the native ones' squared norm (SwiftKV's hidden-state MSE)
    c.loss.hidden_weight = 0.0
    c.loss.attention_weight = 0.0  # ours: nu on each written layer's attention-output error under native queries
    c.loss.load_balance_weight = 0.01
    c.loss.z_loss_weight = 0.001

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-4
    c.optim.weight_decay = 0.01
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.warmup_steps = 50
    c.optim.clip_norm = 1.0

    c.steps = 500
    c.batch_size = 4  # sequences per micro-batch (global, over all devices)
    c.grad_accum = 4  # micro-batches per optimizer step
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1: all devices the expert and tensor axes leave
    c.mesh.expert = 1
    c.mesh.tensor = 1  # the frozen LLMs' attention heads and MLP split over this many devices (Megatron-style)
    c.mesh.fsdp = False  # split the frozen LLMs' weights (and the translator's) over `data` too
    c.mesh.translator_fsdp = ""  # the mesh axis (data, tensor) the translator and its AdamW state split over ("": data
    # with `fsdp`, else none)

    c.log_every = 25
    c.eval_every = 100
    c.eval_batches = 8  # validation batches for the validation loss
    c.checkpoint_every = 100
    c.keep_checkpoints = 3
    c.final_eval_batches = 16  # held-out batches for the closing no-context / native / translated comparison
    return c


TINY_TRANSLATOR = dict(dim=32, heads=2, depth=1, mlp_ratio=2)


def dial(c: ml_collections.ConfigDict, native_bottom: int) -> ml_collections.ConfigDict:
    """The quickstart's operating point (docs/results/2026-12-01-dial.md): the target's own bottom `native_bottom`
    layers over the context, a least-squares-started linear map per upper layer from the source's K/V, the target's
    token embeddings and its residual stream, 30 steps of prompt CE + K/V MSE on chunks of which half are retrieval
    rows."""
    c.translator.update(mode="direct", kind="linear", linear_skip=True, rotary=True, output_activation="none")
    c.translator.update(native_bottom=native_bottom, inputs="source,embeddings,hidden", skip_fit_batches=24)
    c.data.copy_fraction = 0.5
    c.data.total_tokens, c.data.prefix_tokens, c.data.source_length = 256, 192, 256
    c.steps, c.batch_size, c.grad_accum = 30, 4, 1
    c.optim.learning_rate, c.optim.warmup_steps = 3e-4, 5
    c.log_every, c.eval_every, c.checkpoint_every = 5, 10, 10
    c.eval_batches, c.final_eval_batches = 4, 8
    return c


def tiny(c: ml_collections.ConfigDict, source: str, target: str) -> ml_collections.ConfigDict:
    """Shrink a config to a seconds-long CPU run on tiny random models of the given families."""
    c.source, c.target = f"random:{source}", f"random:{target}"
    c.data.corpus = "docs_prose"  # offline, whatever corpus the full run reads
    c.data.total_tokens, c.data.prefix_tokens, c.data.source_length = 32, 16, 48
    c.translator.update(TINY_TRANSLATOR)
    c.translator.k_attn, c.translator.dense_bottom = 4, 1
    # with 4 layers, 0.3 would leave a one-layer window at the top, whose translation cannot reach the replayed cache
    c.translator.channels.ratio = c.translator.channels.min_ratio = c.translator.channels.max_ratio = 0.5
    c.translator.channels.search_steps, c.translator.channels.search_eval_batches = 2, 1
    c.steps, c.batch_size, c.grad_accum = 4, 2, 2
    c.mesh.data, c.mesh.expert, c.mesh.tensor, c.mesh.fsdp = 1, 1, 1, False  # one device: tiny batches do not split
    c.optim.warmup_steps = 1
    c.log_every, c.eval_every, c.checkpoint_every = 1, 2, 2
    c.eval_batches, c.final_eval_batches = 1, 2
    return c


GPU_ARGS = ("gpu1", "gpu8")


def resize_step(c: ml_collections.ConfigDict, batch_size: int, grad_accum: int, total_tokens: int):
    """A step of `batch_size` sequences (over all devices) of `total_tokens` per micro-batch and `grad_accum`
    micro-batches; the context keeps its share of the chunk and the source its room (prefix_tokens and source_length
    scaled with total_tokens)."""
    scale = total_tokens / c.data.total_tokens
    c.data.prefix_tokens = round(c.data.prefix_tokens * scale)
    c.data.source_length = round(c.data.source_length * scale)
    c.data.total_tokens, c.batch_size, c.grad_accum = total_tokens, batch_size, grad_accum
    return c


def gpu_step(c: ml_collections.ConfigDict, arg: str, batch_size: int, grad_accum: int, total_tokens: int):
    """`:gpu1` / `:gpu8`: the step sized to fill one 80 GB GPU or eight (`resize_step`), in bfloat16; the mesh's
    data axis spans the GPUs its expert axis leaves (one GPU: no expert split)."""
    resize_step(c, batch_size, grad_accum, total_tokens)
    c.dtype = "bfloat16"
    c.mesh.data = -1
    if arg == "gpu1":
        c.mesh.expert = 1
    return c


def parse_arg(arg: str | None, allowed=("tiny", *GPU_ARGS)) -> str | None:
    if arg not in (None, "", *allowed):
        raise MotJaxError(f"Unknown config argument {arg!r}; use one of: {', '.join(allowed)} (or none).")
    return arg or None


# keys that count or divide: each must be a whole number of at least this
COUNTS = {
    "steps": 1,
    "batch_size": 1,
    "grad_accum": 1,
    "log_every": 1,
    "eval_every": 1,
    "checkpoint_every": 1,
    "keep_checkpoints": 1,
    "eval_batches": 1,
    "final_eval_batches": 0,
    "data.train_chunks": 0,  # 0: the whole table
    "data.max_documents": 0,  # 0: every document
    "data.source_length": 1,
    "translator.dim": 1,
    "translator.heads": 1,
    "translator.num_experts": 1,
    "translator.top_k": 1,
    "translator.skip_ridge_held_out": 0,
    "translator.receiver_rank": 0,  # 0: the target stays frozen
    "optim.warmup_steps": 0,  # 0 (as 1): the full rate from the first update
}
# numbers with a range: key -> (the range in words, whether a value is in it). Each loss term's weight (a negative
# one would train the translator to maximise that term) and the fit's ridge; the KL's temperature, no weight. AdamW's
# (`optim.adamw`): a learning rate of 0 keeps a linear skip's least-squares start as it is; a clip norm of 0 would
# scale every update to 0 (or NaN). Shares of the batch's rows and of the layers; the experts' capacity (an infinite
# one overflowed the dispatch)
AT_LEAST_0 = ("a finite number of at least 0", lambda v: 0 <= v < math.inf)
ABOVE_0 = ("above 0 and finite", lambda v: 0 < v < math.inf)
SHARE = ("a share from 0 to 1", lambda v: 0 <= v <= 1)
LAYER_SHARE = ("a share of the layers above 0 and at most 1", lambda v: 0 < v <= 1)
WEIGHTS = [f"loss.{k}" for k in base().loss if k != "distill_temperature"] + ["translator.skip_ridge"]
RANGES = {
    **dict.fromkeys(WEIGHTS, AT_LEAST_0),
    "loss.distill_temperature": ABOVE_0,
    "optim.learning_rate": AT_LEAST_0,
    "optim.weight_decay": AT_LEAST_0,
    "optim.b1": ("at least 0 and below 1", lambda v: 0 <= v < 1),
    "optim.b2": ("at least 0 and below 1", lambda v: 0 <= v < 1),
    "optim.eps": ABOVE_0,
    "optim.clip_norm": ("above 0 and finite (a large norm clips nothing)", lambda v: 0 < v < math.inf),
    "data.copy_fraction": SHARE,
    "data.question_fraction": SHARE,
    "data.fact_fraction": SHARE,
    "translator.channels.ratio": LAYER_SHARE,
    "translator.channels.min_ratio": LAYER_SHARE,
    "translator.channels.max_ratio": LAYER_SHARE,
    "translator.capacity_factor": ABOVE_0,
}


def to_json(c: ml_collections.ConfigDict, **kwargs) -> str:
    """The config as JSON (a run's config.json, its checkpoints' meta), strict as every JSON file here: a
    non-finite float that no check refused is written as null, not as the bare Infinity or NaN JSON does not allow."""
    return strict_json(json.loads(c.to_json_best_effort()), **kwargs)


def lookup(c: ml_collections.ConfigDict, key: str):
    for part in key.split("."):
        c = c[part]
    return c


def missing_keys(c: ml_collections.ConfigDict, reference: ml_collections.ConfigDict, prefix: str = "") -> list:
    """The dotted keys of `reference` (`base()`) that `c` lacks."""
    missing = []
    for key, value in reference.items():
        if key not in c:
            missing.append(prefix + key)
        elif isinstance(value, ml_collections.ConfigDict) and isinstance(c[key], ml_collections.ConfigDict):
            missing += missing_keys(c[key], value, f"{prefix}{key}.")
    return missing


def check(c: ml_collections.ConfigDict):
    """Refuse counts and weights that cannot run (before anything is loaded or written)."""
    missing = missing_keys(c, base())
    if missing:  # a config file written from scratch: every later read of a missing key would be a traceback
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MotJaxError(
            f"The config has no key {missing[0]}{more}; start it from mot_jax.training.config.base(), which has "
            "every key at its default, as the files in configs/ do."
        )
    kinds.get(c.translator.kind)  # an unknown kind: refused here, in one line
    if c.remat not in REMAT_POLICIES:
        raise MotJaxError(f"remat={c.remat!r} is not one of {', '.join(REMAT_POLICIES)}; pass --config.remat=dots.")
    for key, least in (COUNTS | {f"translator.{k}": least for k, least in kinds.counts().items()}).items():
        value = lookup(c, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise MotJaxError(
                f"{key}={value!r} must be a whole number of at least {least}; pass --config.{key}=N with N >= {least}."
            )
    for key, (needs, allowed) in RANGES.items():
        value = lookup(c, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not allowed(value):
            raise MotJaxError(
                f"{key}={value!r} must be {needs}; pass --config.{key}=X, e.g. the default {lookup(base(), key)!r}."
            )
    if c.translator.receiver_rank and not (c.loss.ce_weight or c.loss.distill_weight):
        raise MotJaxError(
            "translator.receiver_rank trains the target's queries on the prompt read after the translation, but "
            "loss.ce_weight and loss.distill_weight are both 0; set one of them above 0 or receiver_rank=0."
        )
    # another kind's field set away from its default would change nothing
    kinds.check_foreign_fields(c.translator.kind, {k: c.translator[k] for k in kinds.fields() if k in c.translator})
    d = c.data
    if not 2 <= d.prefix_tokens < d.total_tokens:  # the context (prefix - 1 tokens) and a prompt of one or more
        raise MotJaxError(
            f"data.prefix_tokens={d.prefix_tokens} does not fit data.total_tokens={d.total_tokens}; pass "
            "2 <= prefix_tokens < total_tokens."
        )
    held_out, fit_batches = c.translator.skip_ridge_held_out, c.translator.skip_fit_batches
    if held_out and held_out >= fit_batches:
        raise MotJaxError(
            f"translator.skip_ridge_held_out={held_out} leaves none of translator.skip_fit_batches={fit_batches} to "
            f"fit on; pass a number below {fit_batches}, or raise skip_fit_batches."
        )
    if c.data.get("feature_cache"):
        if c.loss.get("ce_weight", 1.0) or c.loss.distill_weight:
            raise MotJaxError(
                "data.feature_cache=True serves KV-space objectives, but the prompt CE / KL run the target over the "
                "prompt after the translated cache every step; pass --config.loss.ce_weight=0 "
                "--config.loss.distill_weight=0, or data.feature_cache=False."
            )
        rewritten = [k for k in ("copy_fraction", "question_fraction", "fact_fraction") if c.data.get(k)]
        if rewritten:
            raise MotJaxError(
                f"data.feature_cache=True stores each chunk's own prompt, but data.{rewritten[0]} rewrites prompts per "
                f"step; pass --config.data.{rewritten[0]}=0 (with no CE its rows change nothing else)."
            )
