"""Load a checkpoint into mot_jax and optionally check it against transformers.

  python -m mot_jax.convert --model=gemma3-270m --check          # an embedded model (GGUF shipped by pip)
  python -m mot_jax.convert --check qwen2.5-coder-0.5b           # the model may also be the one argument
  python -m mot_jax.convert --model=/path/to/hf_dir --check      # a Hugging Face directory (or hub id, or .gguf)

--check runs the transformers PyTorch model on the same tokens (for GGUF, transformers' own GGUF loading of the same
file) and compares the logits and every layer's K/V, then greedy-decodes `--new_tokens` tokens on both sides.
Exit status: 0 loaded (and, with --check, within tolerance and the same tokens), 1 the check failed, 2 bad input.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from absl import app, flags, logging

from mot_jax.cli import fail, flags_parser, no_arguments
from mot_jax.errors import MotJaxError

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Embedded model name, .gguf file, Hugging Face id or local checkpoint directory.")
flags.DEFINE_bool("check", False, "Compare logits, every layer's K/V and greedy tokens with transformers.")
flags.DEFINE_float("atol", None, "Absolute tolerance of --check (default 1e-4 in float32, 1e-3 for GGUF, 0 in bf16).")
flags.DEFINE_float("rtol", None, "Tolerance relative to each tensor's largest magnitude (default 0; 0.05 in bf16).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and compute dtype.")
flags.DEFINE_multi_string(
    "prompt",
    ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"],
    "Prompts for --check (repeat the flag for several).",
)
flags.DEFINE_integer("new_tokens", 20, "Greedy tokens that must agree in --check (0: skip).")
flags.DEFINE_integer("seed", 0, "Seed of the random token ids used when the checkpoint has no tokenizer.")


def default_tolerance(dtype, is_gguf):
    """(atol, rtol): bf16 keeps 8 mantissa bits, so its differences scale with each tensor's magnitude."""
    if dtype == "bfloat16":
        return 0.0, 0.05
    return (1e-3 if is_gguf else 1e-4), 0.0


def check_inputs(tokenizer_dir, prompts, vocab_size, seed):
    """[(description, ids [1, T])]: each prompt through the checkpoint's tokenizer, or random ids without one."""
    import numpy as np

    if (tokenizer_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        return [(repr(p), np.asarray([tokenizer.encode(p).ids])) for p in prompts]
    if (tokenizer_dir / "tokenizer_config.json").is_file() or (tokenizer_dir / "vocab.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        return [(repr(p), np.asarray([tokenizer(p)["input_ids"]])) for p in prompts]
    ids = np.random.default_rng(seed).integers(0, vocab_size, size=(1, 16))
    return [("16 random token ids (no tokenizer found)", ids)]


def reference_model(model_dir: Path, gguf_path: Path | None):
    import torch
    from transformers import AutoModelForCausalLM

    if gguf_path is not None:  # transformers de-quantizes the same file (it needs accelerate)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def convert(
    model_name, check=False, atol=None, rtol=None, dtype="float32", prompts=None, new_tokens=20, seed=0, out=print
):
    """The command as a function: returns the exit status (tests call this directly)."""
    from mot_jax.models import gguf, loading, registry

    start = time.perf_counter()
    gguf_path = gguf.resolve_gguf(model_name)
    if gguf_path is not None:
        embedded = model_name if model_name in gguf.EMBEDDED else None
        model, _, model_dir = gguf.convert(gguf_path, embedded, dtype)
    else:
        model_dir = loading.resolve_model_dir(model_name)
        model, _ = loading.load_model(str(model_dir), dtype=dtype)
    cfg = model.config
    count = sum(p.size for p in registry.flat_params(model).values())
    out(
        f"loaded {model_name}: {cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{count:,} parameters in {dtype} ({time.perf_counter() - start:.1f} s)"
    )
    if not check:
        return 0

    from mot_jax.models.verify import compare_with_transformers, greedy_agreement

    default_atol, default_rtol = default_tolerance(dtype, gguf_path is not None)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    reference = reference_model(model_dir, gguf_path)
    ok = True
    for what, ids in check_inputs(model_dir, prompts or FLAGS["prompt"].default, cfg.vocab_size, seed):
        result = compare_with_transformers(model, reference, ids)
        line = f"{what} ({ids.shape[1]} tokens): {result.summary()}"
        ok &= result.ok(atol, rtol)
        if new_tokens:
            agree = greedy_agreement(model, reference, ids, new_tokens)
            line += f"; greedy tokens: {agree} of {new_tokens} agree before the first difference"
            ok &= agree == new_tokens or dtype != "float32"  # bf16 rounding may flip a near-tie: report only
        out(line)
    tolerance = f"atol {atol:g}" + (f" + rtol {rtol:g} x magnitude" if rtol else "")
    out(f"OK: within {tolerance}" if ok else f"FAILED: a difference exceeds {tolerance} or greedy tokens differ")
    return 0 if ok else 1


def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) == 2 and not FLAGS.model:  # `python -m mot_jax.convert --check NAME`
        FLAGS.model = argv[1]
    else:
        no_arguments(argv)
    if not FLAGS.model:
        fail("--model is required: an embedded model name, a .gguf file, a hub id or a directory (--help lists them).")
    try:
        status = convert(
            FLAGS.model,
            FLAGS.check,
            atol=FLAGS.atol,
            rtol=FLAGS.rtol,
            dtype=FLAGS.dtype,
            prompts=FLAGS.prompt,
            new_tokens=FLAGS.new_tokens,
            seed=FLAGS.seed,
        )
        sys.exit(status)
    except MotJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser)
