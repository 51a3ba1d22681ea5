"""KVComm, the reference's `alg/kvcomm` baseline: no translator, the source's raw K/V at chosen layers.

The source (sender) reads the target's own context tokens and hands over its K/V; target (receiver) layer j reads
source layer j (the reference maps j to round((j + .5) * L_s / L_t - .5), the identity at the one depth KVComm
allows). At the selected layers, and always at layer 0, the target's attention reads the source's K/V of the whole
context; at every other layer it reads only the context's first token (each row's first valid slot). The target
then reads the question after this cache as after any other: its own suffix K/V are concatenated after the
source's at every layer, with positions continuing the context's.

The layers are chosen once, by the reference's attention-importance calibration on the target: `calib_size`
sequences of `total_tokens` target tokens of a text corpus; per layer, the attention mass the last
`total_tokens - prefix_tokens` queries put on the first `prefix_tokens` keys (summed over those keys, averaged
over heads, queries and sequences); min-max normalised, mixed with a min-max-normalised Gaussian prior over layer
index (centre `mu * (L - 1)`, width `sigma`) as `alpha * attention + (1 - alpha) * prior`; the top
`round(top_layers * L)` layers are kept (`np.argsort(scores)[::-1]`, the reference's order, breaks ties).
Defaults are the reference's `train_kvcomm.json`: top_layers 0.5, alpha 1 (prior unused), mu 0.5, sigma 5,
32 sequences of 128 tokens with a 64-token prefix.

Where this differs from the reference: the calibration text is a configurable corpus (default the offline
`docs_prose`; the reference streams OpenWebText's train split); a non-selected layer's suffix attention is
causal over [first context token, suffix] (the reference hands that layer a one-token cache, whose causal mask
its per-layer mask slicing then depends on); the bytes handed over count what is sent (the sent layers' K/V of
every context token, one token's at the others) rather than the whole source cache.

It needs one architecture and depth, KV shapes and vocabulary (the source reads the target's token ids); other
pairs are refused (`check_pair`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import struct

from mot_jax.errors import MotJaxError
from mot_jax.evals.config import kvcomm_defaults as defaults
from mot_jax.evals.methods import Method, kv_bytes
from mot_jax.evals.prompts import token_ids
from mot_jax.jit import jit
from mot_jax.models.base import first_valid_index
from mot_jax.models.generation import prefill
from mot_jax.models.hooks import Forward, LayerHook
from mot_jax.models.layers import attention_weights

# What must match for the target's attention to read the source's K/V as its own.
MATCHING = ("family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")


def check_pair(source, target, names=("source", "target")) -> None:
    """Refuse, in one line, a pair whose K/V the target cannot read as its own (configs: `ModelConfig`)."""
    differ = [
        f"{f} {getattr(source, f)} vs {getattr(target, f)}"
        for f in MATCHING
        if getattr(source, f) != getattr(target, f)
    ]
    if differ:
        raise MotJaxError(
            f"kvcomm hands the source's raw K/V to the target's attention layer by layer, so it needs one "
            f"architecture, depth and vocabulary, but {names[0]} -> {names[1]} differ in {'; '.join(differ)}; "
            "evaluate it on a homogeneous pair (e.g. --config.pair=smollm2-135m,smollm2-135m)."
        )


# ------------------------------------------------------------------------------------------------ calibration


def _normalize(values: np.ndarray) -> np.ndarray:
    """Min-max to [0, 1]; all zeros when the values (nearly) agree, as the reference does."""
    values = np.asarray(values, np.float32)
    low, high = float(values.min()), float(values.max())
    if high - low < 1e-9:
        return np.zeros_like(values)
    return ((values - low) / (high - low)).astype(np.float32)


def layer_count(top_layers: float, num_layers: int) -> int:
    """How many layers the calibration keeps (the reference: all when top_layers <= 0, else at least one)."""
    if top_layers <= 0:
        return num_layers
    return min(num_layers, max(1, int(round(top_layers * num_layers))))


def rank_layers(raw, alpha: float, mu: float, sigma: float) -> tuple[list[int], np.ndarray]:
    """(layers best first, combined scores) of per-layer attention scores `raw` [L], the reference's rule."""
    layers = len(raw)
    positions = np.arange(layers, dtype=np.float32)
    prior = _normalize(np.exp(-0.5 * ((positions - mu * max(0, layers - 1)) / sigma) ** 2))
    combined = alpha * _normalize(raw) + (1.0 - alpha) * prior
    return np.argsort(combined)[::-1].astype(int).tolist(), combined


@dataclasses.dataclass(frozen=True)
class Calibration:
    selected: tuple[int, ...]  # the calibration's layers (sorted); layer 0 is sent whether or not it is here
    num_layers: int
    attention: tuple[float, ...] = ()  # per layer: mean attention mass of the suffix queries on the prefix
    scores: tuple[float, ...] = ()  # per layer: the combined score the ranking used
    ranking: tuple[int, ...] = ()

    @property
    def sent(self) -> tuple[int, ...]:
        """The layers whose K/V of the whole context are handed over: the selected ones and layer 0."""
        return tuple(sorted({0, *self.selected}))

    def as_dict(self) -> dict:
        return dict(dataclasses.asdict(self), sent=list(self.sent))


def select_layers(raw, top_layers: float, alpha: float, mu: float, sigma: float) -> Calibration:
    """The calibration's choice from per-layer attention scores `raw` [L] (see the module docstring)."""
    raw = np.nan_to_num(np.asarray(raw, np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    layers = len(raw)
    count = layer_count(top_layers, layers)
    if count >= layers:
        return Calibration(tuple(range(layers)), layers, tuple(map(float, raw)))
    ranking, combined = rank_layers(raw, alpha, mu, sigma)
    return Calibration(
        tuple(sorted(ranking[:count])), layers, tuple(map(float, raw)), tuple(map(float, combined)), tuple(ranking)
    )


@struct.dataclass
class _MassProbe(LayerHook):
    """Records per layer and row (`records["mass"]`) the attention mass of queries from `prefix` on of a fresh prefill
    on its first `prefix` keys (summed over keys, averaged over heads and queries)."""

    prefix: int = struct.field(pytree_node=False)

    def attention(self, read, layer, record):
        m = read.mask
        probs = attention_weights(
            read.q, read.k, m.q_pos, m.k_pos, m.k_valid, scale=read.scale, window=m.window, softcap=read.softcap
        )  # [B, K, G, T, T]
        record.put("mass", probs[..., self.prefix :, : self.prefix].sum(-1).mean(axis=(1, 2, 3)))
        return read


@jit(static_argnames=("prefix",))
def attention_mass(model, ids, *, prefix: int):
    """[L, B] per layer and row: the attention mass that queries `prefix..T-1` of `ids` [B, T] (no padding) put
    on keys `0..prefix-1`, summed over keys and averaged over heads and queries."""
    return model.run_layers(Forward(ids), hooks=[_MassProbe(prefix)]).records["mass"]


def calibration_rows(tokenizer, texts, count: int, total_tokens: int, eos_id: int) -> np.ndarray:
    """[N <= count, total_tokens] target ids: the texts tokenized, each followed by EOS, packed and cut."""
    stream, needed = [], count * total_tokens
    for text in texts:
        if text.strip():
            stream += token_ids(tokenizer, [text], False)[0] + [eos_id]
        if len(stream) >= needed:
            break
    rows = min(count, len(stream) // total_tokens)
    if rows < 1:
        raise MotJaxError(
            f"The kvcomm calibration text holds {len(stream)} tokens, fewer than one {total_tokens}-token sequence; "
            "pass a larger --config.kvcomm.corpus or lower --config.kvcomm.total_tokens."
        )
    return np.asarray(stream[: rows * total_tokens], np.int32).reshape(rows, total_tokens)


def calibrate(model, tokenizer, texts, settings, batch_size: int = 8) -> Calibration:
    """The target layers KVComm sends, from the target's attention on `texts` (an iterable of strings)."""
    s = settings
    if not 1 <= s.prefix_tokens < s.total_tokens:
        raise MotJaxError(
            f"kvcomm.prefix_tokens={s.prefix_tokens} does not fit kvcomm.total_tokens={s.total_tokens}; pass "
            "1 <= prefix_tokens < total_tokens."
        )
    eos = model.config.eos_ids
    if not eos:
        raise MotJaxError("The target defines no EOS token id, which separates the kvcomm calibration documents.")
    rows = calibration_rows(tokenizer, texts, s.calib_size, s.total_tokens, eos[0])
    mass = [
        np.asarray(attention_mass(model, jnp.asarray(rows[i : i + batch_size]), prefix=s.prefix_tokens))
        for i in range(0, len(rows), batch_size)
    ]
    raw = np.concatenate(mass, axis=1).mean(axis=1)
    return select_layers(raw, s.top_layers, s.alpha, s.mu, s.sigma)


def manual_layers(value, num_layers: int) -> tuple[int, ...]:
    layers = sorted({int(x) for x in str(value).split(",") if x.strip()})
    bad = [x for x in layers if not 0 <= x < num_layers]
    if bad:
        raise MotJaxError(f"kvcomm.layers has {bad[0]}, outside the target's layers 0..{num_layers - 1}.")
    return tuple(layers)


def corpus_texts(corpus: str, data_dir, seed: int):
    """The corpus's training documents in a seeded order (lazily: calibration reads only the first few)."""
    from mot_jax.training import corpus as corpus_lib

    documents = corpus_lib.documents(corpus, data_dir or None)["train"]
    for i in np.random.default_rng(seed).permutation(len(documents)):
        yield documents[int(i)]


# ------------------------------------------------------------------------------------------------ the cache


@jit
def handover(cache, sent):
    """The target's cache from the source's cache of a context (`cache`, nothing after the context yet) and the
    layers sent (`sent` [L] bool): at the other layers every context slot but each row's first is hidden (and its
    K/V zeroed: not handed over)."""
    slots = jnp.arange(cache.capacity)
    first = slots[None, :] == first_valid_index(cache.valid)[:, None]  # [B, S]
    hidden = cache.valid[None] & ~first[None] & ~sent[:, None, None]  # [L, B, S]
    keep = ~hidden[:, :, None, :, None]
    return cache.replace(k=jnp.where(keep, cache.k, 0), v=jnp.where(keep, cache.v, 0), hidden=hidden)


class KVComm(Method):
    """The `kvcomm` row: `prepare(models)` checks the pair and calibrates; `build` hands over the source's K/V."""

    name = "kvcomm"
    source_stage = "source_prefill"

    def __init__(self, settings=None, data_dir=None, names=("source", "target")):
        self.settings = settings if settings is not None else defaults()
        self.data_dir, self.names = data_dir, names  # the corpus's data dir; the pair's names for messages
        self.calibration: Calibration | None = None

    def prepare(self, models) -> None:
        check_pair(models.source.config, models.target.config, self.names)
        layers, s = models.target.config.num_layers, self.settings
        if str(s.layers).strip():
            self.calibration = Calibration(manual_layers(s.layers, layers), layers)
        elif layer_count(s.top_layers, layers) >= layers:
            self.calibration = Calibration(tuple(range(layers)), layers)
        else:
            texts = corpus_texts(s.corpus, self.data_dir, s.seed)
            self.calibration = calibrate(models.target, models.target_tokenizer, texts, s)
        self.name = f"KVComm ({len(self.calibration.sent)} of {layers} layers)"

    @property
    def sent_mask(self):
        c = self.calibration
        return jnp.asarray(np.isin(np.arange(c.num_layers), c.sent))

    def build(self, models, contexts, capacity, watch):
        if self.calibration is None:
            self.prepare(models)
        _, cache = prefill(models.source, contexts.ids, contexts.mask, capacity=capacity)
        cache = watch.lap("source_prefill", cache)
        cache = watch.lap("handover", handover(cache, self.sent_mask))
        return cache, self.handed(models, contexts.mask)

    def handed(self, models, mask) -> np.ndarray:
        """Bytes per row: the sent layers' K/V of every context token and one token's at the other layers."""
        sent, layers = len(self.calibration.sent), self.calibration.num_layers
        one = kv_bytes(models.source, 1, layers - sent)
        return np.array([kv_bytes(models.source, int(n), sent) + one for n in np.asarray(mask).sum(1)])

    def programs(self, models, contexts, capacity) -> list:
        """The lowered programs it runs before the target reads the question (for the memory plan)."""
        cache = prefill(models.source, contexts.ids, contexts.mask, capacity=capacity)[1]
        return [
            prefill.lower(models.source, contexts.ids, contexts.mask, capacity=capacity),
            handover.lower(cache, self.sent_mask),
        ]
