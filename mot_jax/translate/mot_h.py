"""The MoT-h baseline (`TranslatorConfig.kind="mot_h"`): the mixture translating hidden states in place of K/V.

Reference section 7 (`mot-h`), checked against the MoT authors' `alg/mot-h/train.py` (prosopher/MoT at 889a9704):

- what the source sends: the input residual stream of each source window layer (the tensor its decoder layer is
  called with: for layer 0 the embeddings), stacked as x [B, T, W, Ds], aligned onto the target's tokens as K/V are;
- the module: one mixture of the paper's cross-layer window translators (`MixtureOfTranslators`, the same sizes and
  routing as MoT's), Ds -> Dt per window layer, held as `KVTranslator.hidden` (one, not a K and a V mixture);
- the injection: an ordinary dense forward of the target over its context in which each window layer's input
  residual stream is replaced by its translation (the reference's forward pre-hooks; `Injection.hidden`); every
  layer's cache, the window's included, is the target's own K/V of that forward, and is what generation reads;
- the loss: MoT's, the prompt CE plus the Context Correction MSE over the layers from the window's first to the top.

The window is MoT's channel map (`mode="replay"`); the target attends densely, as in the reference's ordinary
forward. Differences, each small: the source reads the target's text and is aligned onto the target's tokens as for
every translator here (the reference feeds one token sequence to both models), and the context's first token keeps
the target's own residual stream (it attends only to itself; for Gemma the BOS, the attention sink), as the other
translators keep its K/V (`translator.py`). The output GELU is the reference's (the translated streams are then
>= -0.17 in every channel); `output_activation="none"` drops it.

What the source hands over is carried in the cache layout (`translator.source_read`), so that batching, the
alignment, the shuffled-source control and the window pick take it as they take K.
"""

from __future__ import annotations

from mot_jax.errors import MotJaxError


def check_spec(spec, cfg):
    """Refuse the switches that mean nothing for MoT-h (a dense target forward with its window's inputs replaced),
    each in one line."""
    refusals = (
        (spec.mode != "replay", "replaces the inputs of the channel map's window layers; set mode='replay'"),
        (spec.sparse_attention, "runs an ordinary dense target forward, as the reference; set sparse_attention=False"),
        (tuple(spec.inputs) != ("source",), "reads the source's layer inputs alone; set inputs='source'"),
        (spec.rotary, "translates residual streams, which hold no rotated keys; set rotary=False"),
        (
            spec.outputs != "residual",
            "writes residual streams; build its spec with TranslationSpec.build(residual=True)",
        ),
        (cfg.linear_skip, "has no linear skip; set linear_skip=False"),
    )
    for refused, why in refusals:
        if refused:
            raise MotJaxError(f"kind='mot_h' {why}.")
