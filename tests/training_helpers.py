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


def whole_and_resumed(config, root, monkeypatch, stop_after: int):
    """`config` trained in root/whole at once and in root/resumed stopped by Ctrl-C after step `stop_after` and run
    again: (the whole run's summary, the two runs' trained translators, the same where resuming is exact)."""
    import pytest

    from mot_jax.training import loop
    from mot_jax.training.trained import load_trained

    whole = loop.train_and_evaluate(config, root / "whole")
    step, calls = loop.Trainer.train_step, []

    def interrupted(self, batches):  # Ctrl-C as step stop_after + 1 starts
        calls.append(1)
        if len(calls) == stop_after + 1:
            raise KeyboardInterrupt
        return step(self, batches)

    with monkeypatch.context() as patch:
        patch.setattr(loop.Trainer, "train_step", interrupted)
        with pytest.raises(loop.Interrupted, match=f"interrupted after step {stop_after}"):
            loop.train_and_evaluate(config, root / "resumed")
    loop.train_and_evaluate(config, root / "resumed")
    return whole, [load_trained(root / name).translator for name in ("whole", "resumed")]
