"""Times the model layer's forwards and the translators' translation in one checkout, to put two commits side by side:
the offline pair's target prefill (Gemma-3-270M, 512 tokens) and 32 greedy decoding steps after it, and the
quickstart's translators translating 512 tokens (`:replay`, sparse replay; the default, the dial at B=8), random
translator weights, each jitted, the median of 7 after a warm-up. Run it from each checkout in turn:

    cd CHECKOUT && PYTHONPATH=$PWD python launch/refactor_speed.py
"""

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path.cwd() / "tests"))
from helpers import load_config, perturb  # noqa: E402

from mot_jax.models.generation import generate_from_cache_jit, prefill  # noqa: E402
from mot_jax.training.setup import translation  # noqa: E402
from mot_jax.translate import align as alignment_lib  # noqa: E402
from mot_jax.translate import channels  # noqa: E402
from mot_jax.translate.pipeline import translate_jit  # noqa: E402
from mot_jax.translate.translator import KVTranslator, source_read  # noqa: E402

try:  # where the model pair is loaded (it moved to models/)
    from mot_jax.models.model_pair import load_pair
except ImportError:
    from mot_jax.training.setup import load_pair


def timed(f, *args, **kwargs) -> float:
    """Milliseconds of one call of `f(*args, **kwargs)`: the median of 7 after a warm-up."""
    jax.block_until_ready(f(*args, **kwargs))
    times = []
    for _ in range(7):
        start = time.perf_counter()
        jax.block_until_ready(f(*args, **kwargs))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main():
    out = {}
    for arg in ("replay", ""):
        config = load_config("quickstart.py", arg)
        pair = load_pair(config)
        ls, lt = pair.source.config.num_layers, pair.target.config.num_layers
        spec, tcfg = translation(config, channels.terminal(ls, lt, config.translator.channels.ratio), pair)
        translator = KVTranslator(spec, tcfg, rngs=nnx.Rngs(0))
        perturb(translator, 1)
        text = Path(jnp.__file__).read_text()[:20000]  # any text of 512 tokens (jax.numpy's source)
        ids = jnp.asarray([pair.target_tokenizer.encode(text).ids[:512]], jnp.int32)
        mask = jnp.ones_like(ids, bool)
        tokenizers = (pair.target_tokenizer, pair.source_tokenizer)
        source_ids, source_mask, alignment = alignment_lib.align_batch(*tokenizers, np.asarray(ids), np.asarray(mask))
        source = (jnp.asarray(source_ids), jnp.asarray(source_mask))
        read, topk = source_read(pair.source, *source, spec.attention_topk, **spec.source_hands)
        args = (translator, pair.source, pair.target, read, alignment, ids, mask, topk)
        out[f"translate {arg or 'dial B=8'}"] = timed(lambda *a: translate_jit(*a, capacity=560)[0].k, *args)
        if arg == "replay":
            out["target prefill 512"] = timed(lambda *a: prefill(*a, capacity=560)[1].k, pair.target, ids, mask)
            cache = prefill(pair.target, ids, mask, capacity=560)[1]
            decode = lambda *a: generate_from_cache_jit(*a, max_new_tokens=32, eos_ids=())  # noqa: E731
            out["decode 32 after 512"] = timed(decode, pair.target, cache, ids[:, :8])
    for name, ms in out.items():
        print(f"{name}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
