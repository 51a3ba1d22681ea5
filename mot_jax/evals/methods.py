"""The methods: each turns the same examples' contexts into a target cache (`Method.build`); the target answers.

Methods (all on the same examples, in one run):
- `no_context`: the target reads the instruction only;
- `native`: the target reads the passage as text (the upper bound);
- `text_relay`: the source writes a summary of the passage, the target reads the summary (a raw-text relay is the
  `native` row: the target re-prefills the same text);
- `kvcomm`: the source's raw K/V at calibrated layers, no translator (`mot_jax.evals.kvcomm`; one family and depth);
- `source alone` (beside every translated method, `SourceAlone`): the source reads the passage and answers itself,
  with its own prompts and TTFT; a translated cache is worth its cost only where the target answering from it beats
  this row;
- translated (one per training workdir): the source reads the passage and the translator builds the target cache;
- `<translated>, shuffled source` (a control beside each translated method, `ShuffledSource`): the same translator
  builds this example's cache from another example's source cache, so the translation carries none of this
  example's passage; a translated method carries the context only where it beats this row.
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.evals.prompts import (
    BUCKET,
    SUFFIX_BUCKET,
    Contexts,
    decode_answers,
    instruction,
    padded,
    prefix_text,
    summary_request,
    token_ids,
)
from mot_jax.jit import jit
from mot_jax.models.generation import generate, prefill
from mot_jax.translate import kinds
from mot_jax.translate.donors import carry, regrid
from mot_jax.translate.pipeline import (
    SourceRead,
    bottom_run_jit,
    read_source,
    runs_source,
    target_side_jit,
    translate_jit,
)
from mot_jax.translate.recompute import check_share, on_window_path, recompute

BASELINES = ("no_context", "native", "text_relay", "kvcomm")  # kvcomm: evals/kvcomm.py (one model family and depth)


class Stopwatch:
    """Seconds per stage; each stage ends when its device work is done."""

    def __init__(self):
        self.stages, self._start = {}, time.perf_counter()

    def lap(self, stage: str, result):
        jax.block_until_ready(result)
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._start
        self._start = now
        return result

    def shared(self, stage: str, store: dict, key, compute, ready=lambda result: result):
        """`compute()`'s result, computed once per `store` (a batch's `Contexts.shared`) for every row that reads it;
        each reader's stage is charged the time it took, as if the reader ran it alone. `ready(result)` is what to
        wait for."""
        before = time.perf_counter()
        if key not in store:
            result = compute()
            jax.block_until_ready(ready(result))
            store[key] = (result, time.perf_counter() - before)
        result, seconds = store[key]
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + before - self._start + seconds
        self._start = now
        return result


def kv_bytes(model, tokens, layers=None) -> int:
    """Bytes of a model's K and V for `tokens` tokens over `layers` layers (default all), in its cache dtype."""
    c = model.config
    layers = c.num_layers if layers is None else layers
    return int(2 * layers * tokens * c.num_kv_heads * c.head_dim * jnp.dtype(model.param_dtype).itemsize)


def held_bytes(model, cache) -> int:
    """Bytes of the K/V a cache holds for its first row's valid tokens (per layer where it hides slots)."""
    valid = np.asarray(cache.valid[0])
    if cache.hidden is None:
        return kv_bytes(model, int(valid.sum()))
    return kv_bytes(model, int((valid & ~np.asarray(cache.hidden[:, 0])).sum()), layers=1)


class Method:
    """A way for the target to get a context: `build(contexts, capacity, watch)` returns (target cache, the bytes
    handed over per row)."""

    name: str
    source_stage: str | None = None  # the stage that is the source's own prefill (excluded from TTFT)
    swaps = False  # answers with the source model (`reader`), not the target
    needs_donors = False  # reads another example's contexts (`Contexts.donors`): a control, without a TTFT of its own

    def reader(self, models, settings):
        """(models, settings) this method answers with: `models.target` reads its cache and answers."""
        return models, settings

    @property
    def answerer(self):
        """Which model answers (`reader`): methods with the same answer in one batch."""
        return "source" if self.swaps else "target"

    def prepare(self, models) -> None:
        """Once, after the models load and before any example (kvcomm checks the pair and calibrates here)."""

    def build(self, models, contexts: Contexts, capacity: int, watch: Stopwatch):
        raise NotImplementedError


class NoContext(Method):
    name = "no_context"

    def build(self, models, contexts, capacity, watch):
        texts = [instruction(e, contexts.closed) for e in contexts.examples]
        ids, mask = padded(token_ids(models.target_tokenizer, texts, True), SUFFIX_BUCKET)
        room = capacity - contexts.length  # what the question and the answer need (the instruction may be longer)
        if not mask.any():  # nothing to read (code completion, a tokenizer without BOS): an empty cache
            cache = watch.lap("prefill", models.target.init_cache(len(texts), room))
        else:
            cache = watch.lap("prefill", prefill(models.target, ids, mask, capacity=ids.shape[1] + room)[1])
        return cache, np.zeros(len(texts), np.int64)


def native_cache(models, contexts: Contexts, capacity: int | None = None, reuse: bool = True):
    """The target's prefill of the batch's contexts, kept on the batch (`Contexts.shared`) for the rows that reuse it
    (the band diagnostic's; `reuse=False` computes it anew, as the native row does to time it)."""
    key = ("native", id(models.target), capacity)
    if reuse and key in contexts.shared:
        return contexts.shared[key]
    contexts.shared[key] = prefill(models.target, contexts.ids, contexts.mask, capacity=capacity)[1]
    return contexts.shared[key]


def passage_bytes(contexts: Contexts) -> np.ndarray:
    """What a row that reads the passage as text is handed: its bytes."""
    return np.array([len(p.encode()) for p in contexts.passages])


class Native(Method):
    name = "native"

    def build(self, models, contexts, capacity, watch):
        return watch.lap("prefill", native_cache(models, contexts, capacity, reuse=False)), passage_bytes(contexts)


SOURCE_ALONE = "source alone"


class SourceAlone(Native):
    """The source model reads the passage and answers itself: native context with the pair swapped (`reader`), in
    the source's own chat format (`chat`, as `prompts.target_chat` gives it for the source)."""

    name = SOURCE_ALONE
    swaps = True

    def __init__(self, chat=None):
        self.chat = chat

    def reader(self, models, settings):
        swapped = dataclasses.replace(
            models,
            source=models.target,
            target=models.source,
            source_tokenizer=models.target_tokenizer,
            target_tokenizer=models.source_tokenizer,
        )
        return swapped, dataclasses.replace(settings, chat=self.chat)


class TextRelay(Method):
    name = "text_relay"

    def __init__(self, tokens: int):
        self.tokens = tokens

    def build(self, models, contexts, capacity, watch):
        requests = [summary_request(models.source_tokenizer, p) for p in contexts.passages]
        rows = [token_ids(models.source_tokenizer, [text], specials)[0] for text, specials in requests]
        ids, mask = padded(rows, BUCKET)
        eos = models.source.config.eos_ids
        out = watch.lap("source_summary", generate(models.source, ids, mask, max_new_tokens=self.tokens))
        summaries = [" ".join(s.split()) for s in decode_answers(models.source_tokenizer, out, eos)]
        texts = [prefix_text(e, contexts.closed, s, contexts.chat) for e, s in zip(contexts.examples, summaries)]
        ids, mask = padded(token_ids(models.target_tokenizer, texts, True), BUCKET)
        room = capacity - contexts.length  # the slots the suffix and the answer need
        cache = watch.lap("prefill", prefill(models.target, ids, mask, capacity=ids.shape[1] + room)[1])
        return cache, np.array([len(s.encode()) for s in summaries])


class Translated(Method):
    """A trained translator from a training workdir: the source reads the passage, the target gets its cache."""

    source_stage = "source_prefill"

    def __init__(self, name: str, translator, workdir: str, step: int):
        self.name, self.translator, self.workdir, self.step = name, translator, workdir, step
        self.load = {}  # "key" / "value" (mot_h: "hidden") -> tokens routed to each expert, summed over the evaluation
        self.adapted = (None, None)  # (a target, it as it reads after this translator's cache): made once (`reader`)

    @property
    def answerer(self):
        return ("adapted", id(self.translator)) if self.translator.changes_reader else "target"

    def reader(self, models, settings):
        """The target answers, as it reads after its translator's cache (`KVTranslator.receiver`: through the query
        projections the translator adapted, and the new tokens' K/V its kind makes, where it does; made once per
        target)."""
        if not self.translator.changes_reader:
            return models, settings
        if self.adapted[0] is not models.target:
            self.adapted = (models.target, self.translator.receiver(models.target))
        return dataclasses.replace(models, target=self.adapted[1]), settings

    def translating(self, models):
        """`models` with the target itself where `reader` put the target as it reads after this cache: the translation
        is the target's own work, as in training, whichever model then reads the cache (a reader whose new tokens'
        K/V are mapped would map the context's first token too, whose K/V are the target's own)."""
        target, reader = self.adapted
        return dataclasses.replace(models, target=target) if reader is not None and models.target is reader else models

    def read_source(self, models, contexts, watch) -> SourceRead:
        """The source's side of a batch, the source having read the contexts' text (no source runs for the
        source-free control): its stage ends when the source's prefill is done. Where the contexts are rows of a
        larger batch (`Contexts.some`: a batch and its donors), the source reads that batch once for every method
        that reads it as this one does."""
        spec, whole = self.translator.spec, contexts.whole or contexts
        key = ("source read", id(models.source), runs_source(spec), spec.attention_topk, *spec.source_hands.values())
        tokenizers = (models.source_tokenizer, models.target_tokenizer)
        read = watch.shared(
            "source_prefill" if runs_source(spec) else "alignment",  # the source-free control runs no source
            whole.shared,
            key,
            lambda: read_source(spec, models.source, *tokenizers, whole.ids, whole.mask, BUCKET),
            lambda read: (read.cache, read.topk),
        )
        return read if contexts.whole is None else read.take(contexts.rows)

    def translate(self, models, contexts, read: SourceRead, capacity, watch):
        """(target cache, aux) of the translator writing the contexts' target grid from `read` (`read_source`). The
        target's own bottom layers over the contexts (the dial's, `CausalLM.run_bottom`) run once per batch for every
        method that reads them (a translator, its shuffled-source control, another run's translator at that bottom)."""
        spec, side, models = self.translator.spec, None, self.translating(models)
        if self.window_path:
            args = (models.target, contexts.ids, contexts.mask)
            run = lambda: bottom_run_jit(*args, native_bottom=spec.native_bottom, capacity=capacity)
            bottom = watch.shared("target_bottom", contexts.shared, self.bottom_key(models, capacity), run)
            side = target_side_jit(*args, bottom, spec=spec, capacity=capacity)
        args = self.translation_args(models, contexts, read)
        return watch.lap("translation", translate_jit(*args, capacity=capacity, side=side))

    @property
    def window_path(self) -> bool:
        return on_window_path(self.translator)

    def bottom_key(self, models, capacity):
        """Where a batch keeps the target's own bottom layers over its contexts (`Contexts.shared`)."""
        return ("target bottom", id(models.target), capacity, self.translator.spec.native_bottom)

    def translation_args(self, models, contexts, read: SourceRead) -> tuple:
        """`translate_jit`'s arguments for the contexts (shared by the timed run and the memory plan)."""
        source, target = models.source, self.translating(models).target
        return self.translator, source, target, read.cache, read.alignment, contexts.ids, contexts.mask, read.topk

    def handed(self, models, source_mask) -> np.ndarray:
        spec = self.translator.spec
        layers = len(set(spec.source_layers)) * spec.reads_source  # the source layers the translator reads
        tokens = np.asarray(source_mask).sum(1)
        return spec.source_reads.handed_bytes(models.source, tokens, layers)  # as its kind declares the read

    def build(self, models, contexts, capacity, watch):
        read = self.read_source(models, contexts, watch)
        cache, aux = self.translate(models, contexts, read, capacity, watch)
        for part in ("key", "value", "hidden"):  # hidden: MoT-h's one mixture
            if "stats" in aux.get(part, {}):
                self.load[part] = self.load.get(part, 0) + np.asarray(aux[part]["stats"]["load"], np.float64)
        return cache, self.handed(models, read.mask)


RECOMPUTING = ", recomputing "  # a recomputing row's name: its translator's, then this and the share


class Recomputed(Translated):
    """A direct translator's cache with the target's own layers above its exact bottom rerun for the `fraction` of
    context tokens the translation got most wrong (`mot_jax.translate.recompute`). Its shuffled-source control
    recomputes the same share of the shuffled translation."""

    def __init__(self, method: Translated, fraction: float):
        check_share(method.translator, fraction, method.name)
        super().__init__(f"{method.name}{RECOMPUTING}{fraction:.0%}", method.translator, method.workdir, method.step)
        self.fraction = fraction

    def translate(self, models, contexts, read: SourceRead, capacity, watch):
        cache, aux = super().translate(models, contexts, read, capacity, watch)
        models = self.translating(models)
        hidden = contexts.shared[self.bottom_key(models, capacity)][0][1]  # timed by the translation's call
        start = self.translator.spec.native_bottom
        redo = recompute(models.target, cache, hidden, contexts.ids, contexts.mask, fraction=self.fraction, start=start)
        return watch.lap("recompute", redo), aux


SHUFFLED = ", shuffled source"  # the name of a method's shuffled-source control: the method's, then this


class ShuffledSource(Method):
    """The control beside a translated method: each example's cache translated from another example's source cache.

    Row b's donor is the next example (cyclically, over all the task's examples, so a batch of one row has one too)
    whose context differs from row b's (datasets such as SQuAD ask several questions about one passage). The source
    reads the donor's prefix, and the donor's alignment is carried onto row b's own target grid by position:
    row b's i-th of n valid tokens takes the donor's floor(i * m / n)-th of m (the identity when n = m), and each
    donor source token goes to the first of row b's tokens that took its donor token or a later one. The translator
    then writes row b's grid (its positions, its mask) from the donor's source K/V. What it reads of row b is the
    number and positions of its tokens and its first token, whose K/V are the target's own (a BOS or the
    instruction's first token, the same for every example): never row b's passage. The target prompt (row b's
    question) is row b's. A replay translator's target (and C2C's, whose own prefill it fuses into) still reads row
    b's text itself, as the method does, so there the row tells whether the translation adds anything to that
    reading; so do a direct translator's
    target-side inputs (its own bottom layers and embeddings, `native_bottom` and `inputs`): only the source is
    another example's.
    """

    source_stage = "source_prefill"
    needs_donors = True

    def __init__(self, method: Translated):
        self.method, self.name = method, f"{method.name}{SHUFFLED}"

    @property
    def answerer(self):
        return self.method.answerer

    def reader(self, models, settings):
        return self.method.reader(models, settings)

    def build(self, models, contexts, capacity, watch):
        if contexts.donors is None:
            raise MotJaxError(f"{self.name} needs another example's context per row; build batches with donors.")
        read = self.method.read_source(models, contexts.donors, watch)
        alignment = regrid(read.alignment, contexts.donors.mask, contexts.mask, read.mask)
        read = dataclasses.replace(read, alignment=alignment)
        cache, _ = self.method.translate(models, contexts, read, capacity, watch)
        return cache, self.method.handed(models, read.mask)


class SwappedBand(Method):
    """The layer-band diagnostic (`--config.diagnose=bands`): native context whose K/V in target layers [lo, hi) are
    another example's (its shuffled-source donor's native K/V, carried onto this row's grid by position as `carry`
    does; keys keep the donor's rotary positions, off by at most the two lengths' difference). Its drop from native
    says how much of the binding of question to answer those layers carry, so where a translator must be exact."""

    needs_donors = True

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi, self.name = lo, hi, f"native, layers {lo}-{hi - 1} from another example"

    def build(self, models, contexts, capacity, watch):
        cache = native_cache(models, contexts, capacity)  # the native row's, and the donors' once for every band
        donor = native_cache(models, contexts.donors)
        carried = carry(contexts.donors.mask, contexts.mask)
        swapped = watch.lap("swap", swap_band(cache, donor, carried, contexts.mask, lo=self.lo, hi=self.hi))
        return swapped, passage_bytes(contexts)


@jit(static_argnames=("lo", "hi"))
def swap_band(cache, donor, carried, mask, lo: int, hi: int):
    """`cache` with layers [lo, hi) of its first T slots' K/V (T = mask's width) taken from `donor`'s slots `carried`
    [B, T], where `mask` is set."""
    index, keep = carried[None, :, None, :, None], mask[None, :, None, :, None]
    width = mask.shape[1]

    def swapped(mine, theirs):
        taken = jnp.take_along_axis(theirs[lo:hi], index, axis=3)
        return mine.at[lo:hi, :, :, :width].set(jnp.where(keep, taken, mine[lo:hi, :, :, :width]))

    return dataclasses.replace(cache, k=swapped(cache.k, donor.k), v=swapped(cache.v, donor.v))


def band_spans(diagnose: str) -> list[tuple[int, int]] | None:
    """The layer bands a non-empty `--config.diagnose` names, as [lo, hi) spans: None for `bands` (the target's
    quarters), the listed ones for `bands:A-B,C-D` (layers A to B, counted from 0, as the rows name them). Anything else
    is refused in one line."""
    kind, colon, listed = diagnose.partition(":")
    spans = [re.fullmatch(r"(\d+)-(\d+)", part.strip()) for part in listed.split(",")] if listed else []
    if kind != "bands" or (colon and not spans) or not all(m and int(m[1]) <= int(m[2]) for m in spans):
        raise MotJaxError(
            f"diagnose={diagnose!r} is not a diagnostic; pass bands (the target's quarters), bands:A-B,C-D (layers A "
            "to B, from 0), or nothing."
        )
    return [(int(m[1]), int(m[2]) + 1) for m in spans] or None


def bands(num_layers: int, spans: list[tuple[int, int]] | None = None, count: int = 4) -> list[SwappedBand]:
    """The diagnostic's rows: one per [lo, hi) span of `spans`, else `count` contiguous bands of the target's layers
    (quarters by default). A span past the target's layers is refused in one line."""
    if spans is None:
        edges = [round(i * num_layers / count) for i in range(count + 1)]
        spans = [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]
    for lo, hi in spans:
        if hi > num_layers:
            raise MotJaxError(
                f"The band of layers {lo}-{hi - 1} is past the target's {num_layers} layers (0-{num_layers - 1}); "
                "pass bands within them."
            )
    return [SwappedBand(lo, hi) for lo, hi in spans]


def method_name(config) -> str:
    """How a trained method is named in reports, from its training config (`Kind.label`)."""
    settings = config.translator
    name = kinds.get(settings.get("kind", "mot")).name_of(settings)
    if "source" not in settings.get("inputs", "source").split(","):
        name = f"source-free {name}"
    return f"{name}, B={settings.native_bottom}" if settings.get("native_bottom", 0) else name


def wants_donors(methods) -> bool:
    return any(m.needs_donors for m in methods)
