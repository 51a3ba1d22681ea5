"""Load a checkpoint into mot_jax and optionally check it against transformers.

  python -m mot_jax.convert --model=gpt2 --check
  python -m mot_jax.convert --model=/path/to/hf_dir --check --atol=1e-4

Exit status: 0 loaded (and within tolerance with --check), 1 the check found a larger difference, 2 bad input.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags, logging

from mot_jax.errors import MotJaxError

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Hugging Face model id or local checkpoint directory.")
flags.DEFINE_bool("check", False, "Compare logits and every layer's K/V with the transformers PyTorch model.")
flags.DEFINE_float("atol", None, "Tolerance for --check (default 1e-4 in float32, 0.25 in bfloat16).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and compute dtype.")
flags.DEFINE_string("prompt", "The capital of France is Paris, and the capital of Italy is", "Text for --check.")
flags.DEFINE_integer("seed", 0, "Seed of the random token ids used when the checkpoint has no tokenizer.")

DEFAULT_ATOL = {"float32": 1e-4, "bfloat16": 0.25}


def check_ids(model_dir, prompt, vocab_size, seed):
    """Token ids of `prompt` from the checkpoint's tokenizer, or 16 random ids when it has none."""
    import numpy as np

    has_tokenizer = any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
    if has_tokenizer:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(model_dir))(prompt)["input_ids"]
        if ids:
            return np.asarray([ids]), "the prompt"
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(1, 16)), "16 random token ids (no tokenizer found)"


def convert(model_name, check=False, atol=None, dtype="float32", prompt=None, seed=0, out=print) -> int:
    """The command as a function: returns the exit status (tests call this directly)."""
    from mot_jax.models import loading

    start = time.perf_counter()
    model_dir = loading.resolve_model_dir(model_name)
    model, _ = loading.load_model(str(model_dir), dtype=dtype)
    cfg = model.config
    count = sum(p.size for p in loading.flat_params(model).values())
    out(
        f"loaded {model_name}: {cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{count:,} parameters in {dtype} ({time.perf_counter() - start:.1f} s)"
    )
    if not check:
        return 0

    import torch
    from transformers import AutoModelForCausalLM

    from mot_jax.models.verify import compare_with_transformers

    atol = DEFAULT_ATOL[dtype] if atol is None else atol
    ids, what = check_ids(model_dir, prompt or FLAGS["prompt"].default, cfg.vocab_size, seed)
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    result = compare_with_transformers(model, reference.eval(), ids)
    out(f"check against transformers on {what} ({ids.shape[1]} tokens): {result.summary()}")
    if result.ok(atol):
        out(f"OK: within atol {atol:g}")
        return 0
    out(f"FAILED: differences exceed atol {atol:g}")
    return 1


def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.model:
        raise app.UsageError("--model is required (a Hugging Face id or a local checkpoint directory).")
    try:
        sys.exit(convert(FLAGS.model, FLAGS.check, FLAGS.atol, FLAGS.dtype, FLAGS.prompt, FLAGS.seed))
    except MotJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
