"""Hand-built training batches for the tiny random models (independent of the corpus and the chunk table)."""

import numpy as np

from mot_jax.training.data import make_batch


def tiny_batch(source_tok, target_tok, batch=2, context=10, prompt=6, source_length=40, offset=0):
    """Consecutive rows of context + prompt + 1 target tokens of Python's documentation, as a training Batch."""
    from pydoc_data.topics import topics

    ids = np.asarray(target_tok.encode(topics["assert"] + topics["while"] + topics["if"]).ids, np.int32)
    stride = context + prompt + 1
    rows = np.stack([ids[(offset + i) * stride : (offset + i + 1) * stride] for i in range(batch)])
    return make_batch(rows, context + 1, source_tok, target_tok, source_length)
