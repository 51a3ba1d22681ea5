"""The outputs of every method on tiny random models, through the public entry points that training and evaluation
call: each registered translator kind's translated cache (and the paper's replay dense and sparse, direct, the dial
with each target-side input), greedy generation from a prompt and from a translated cache, KVComm's calibration mass
and hand-over, the attention loss's recorded reads, the recompute of chosen slots, and the logits of a plain forward.

`tests/test_method_outputs.py` compares them with `tests/fixtures/method_outputs.npz`, saved from the code before
the model layer's hooks replaced its translator-specific arguments (a kind registered since, from the commit that added
it); `python tests/method_outputs.py OUT.npz` saves them from the code checked out (run it on two commits and compare
the files to check that a change keeps every output bit for bit on one machine), and `python tests/method_outputs.py
--add tests/fixtures/method_outputs.npz` adds the outputs the fixture lacks (a new kind's), leaving the others as saved.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import load_config, perturb, tiny_batch  # noqa: E402

from mot_jax.training.setup import translation  # noqa: E402
from mot_jax.translate import channels, kinds  # noqa: E402
from mot_jax.translate.translator import KVTranslator, source_read, translate  # noqa: E402

try:  # where the model pair is loaded (it moved out of training beside this script)
    from mot_jax.models.model_pair import load_pair
except ImportError:
    from mot_jax.training.setup import load_pair


DIAL = {"translator.mode": "direct", "translator.native_bottom": 2}
# (name, config argument of configs/smollm2_gemma3.py, translator overrides) beyond each kind at its recipe
VARIANTS = [
    ("mot_replay_dense", "replay,tiny", {"translator.sparse_attention": False}),
    ("mot_direct", "replay,tiny", {"translator.mode": "direct"}),
    ("linear_dial_b2", "linear,tiny", {"translator.mode": "direct", "translator.native_bottom": 2}),
    ("linear_dial_b2_features", "linear,tiny", {**DIAL, "translator.inputs": "source,embeddings,hidden"}),
    ("linear_dial_b2_hidden_out", "linear,tiny", {**DIAL, "translator.outputs": "hidden"}),
]


def kind_cases():
    for name in kinds.names():
        yield name, "replay,tiny" if name == "mot" else f"{name},tiny", {}
    yield from VARIANTS


def source_flags(spec) -> dict:
    return dict(spec.source_hands) if hasattr(spec, "source_hands") else {}


def translated(arg, overrides, seed=1):
    """(the pair, the batch, the translated cache of a tiny batch at capacity context + 4)."""
    config = load_config("smollm2_gemma3.py", arg, **overrides)
    pair = load_pair(config)
    ls, lt = pair.source.config.num_layers, pair.target.config.num_layers
    spec, tcfg = translation(config, channels.terminal(ls, lt, config.translator.channels.ratio), pair)
    translator = KVTranslator(spec, tcfg, rngs=nnx.Rngs(0))
    perturb(translator, seed=seed)
    batch = jax.tree.map(jnp.asarray, tiny_batch(pair.source_tokenizer, pair.target_tokenizer, batch=3))
    read, topk = source_read(
        pair.source, batch.source_ids, batch.source_mask, spec.attention_topk, **source_flags(spec)
    )
    args = (translator, pair.source, pair.target, read, batch.alignment, batch.context, batch.context_mask, topk)
    cache = jax.jit(lambda *a: translate(*a, capacity=batch.context.shape[1] + 12)[0])(*args)
    return pair, batch, cache


def compute() -> dict[str, np.ndarray]:
    from mot_jax.evals import kvcomm
    from mot_jax.models.generation import generate, generate_from_cache
    from mot_jax.training.objective import attention_error, layer_reads
    from mot_jax.translate.recompute import recompute

    out = {}
    pair = batch = cache = None
    for name, arg, overrides in kind_cases():
        pair, batch, cache = translated(arg, overrides)
        out[f"{name}.k"], out[f"{name}.v"] = np.asarray(cache.k, np.float32), np.asarray(cache.v, np.float32)
        out[f"{name}.valid"] = np.asarray(cache.valid)
    target = pair.target
    question = batch.prompt[:, :4]
    out["generate_from_translated"] = np.asarray(
        generate_from_cache(target, cache, question, max_new_tokens=6, eos_ids=())
    )
    out["generate"] = np.asarray(generate(target, batch.context, batch.context_mask, max_new_tokens=6, eos_ids=()))
    logits, native = target(batch.context, batch.context_mask)
    out["logits"] = np.asarray(logits, np.float32)
    out["mass"] = np.asarray(kvcomm.attention_mass(target, batch.context, prefix=4))
    sent = jnp.arange(target.config.num_layers) % 2 == 0
    handed = kvcomm.handover(native.with_capacity(native.capacity + 12), sent)
    out["kvcomm_generate"] = np.asarray(generate_from_cache(target, handed, question, max_new_tokens=6, eos_ids=()))
    reads = layer_reads(target, batch.prompt, cache=native.with_capacity(native.capacity + batch.prompt.shape[1]))
    out["reads.queries"] = np.asarray(reads.queries, np.float32)
    out["attention_error"] = np.asarray(attention_error(reads, reads.cache.k * 1.1, reads.cache.v))
    hidden = jax.random.normal(jax.random.key(3), (*batch.context.shape, target.config.hidden_size))
    fixed = recompute(target, native, hidden, batch.context, batch.context_mask, fraction=0.5, start=1)
    out["recompute.k"], out["recompute.v"] = np.asarray(fixed.k, np.float32), np.asarray(fixed.v, np.float32)
    return out


if __name__ == "__main__":
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    jax.config.update("jax_default_matmul_precision", "highest")
    if sys.argv[1] == "--add":
        path = Path(sys.argv[2])
        saved = dict(np.load(path))
        added = {name: value for name, value in compute().items() if name not in saved}
        np.savez_compressed(path, **saved, **added)
        print(f"added {sorted(added)} to {path}")
    else:
        np.savez_compressed(sys.argv[1], **compute())
        print(f"saved {sys.argv[1]}")
