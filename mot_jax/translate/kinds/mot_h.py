"""The MoT-h baseline (`TranslatorConfig.kind="mot_h"`): the mixture translating hidden states in place of K/V.

Reference section 7 (`mot-h`), checked against the MoT authors' `alg/mot-h/train.py` (prosopher/MoT at 889a9704):

- what the source sends: the input residual stream of each source window layer (the tensor its decoder layer is
  called with: for layer 0 the embeddings), stacked as x [B, T, W, Ds], aligned onto the target's tokens as K/V are;
- the module: one mixture of the paper's cross-layer window translators (`MixtureOfTranslators`, the same sizes and
  routing as MoT's), Ds -> Dt per window layer, held as `KVTranslator.hidden` (one, not a K and a V mixture);
- the injection: an ordinary dense forward of the target over its context in which each window layer's input
  residual stream is replaced by its translation (the reference's forward pre-hooks; `hooks.ReplaceLayerInputs`);
  every layer's cache, the window's included, is the target's own K/V of that forward, and is what generation reads;
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

import jax.numpy as jnp
import numpy as np

from mot_jax.models.base import first_valid_index
from mot_jax.models.hooks import Forward, LayerInputs
from mot_jax.translate import align as alignment_lib
from mot_jax.translate.hooks import ReplaceLayerInputs
from mot_jax.translate.kinds.registry import LAYER_INPUTS, Kind, Outputs, refuse, register
from mot_jax.translate.mixture import MixtureOfTranslators
from mot_jax.translate.window import window_block


def check_spec(spec, cfg):
    """Refuse the switches that mean nothing for MoT-h (a dense target forward with its window's inputs replaced),
    each in one line."""
    refusals = (
        (spec.mode != "replay", "replaces the inputs of the channel map's window layers; set mode='replay'"),
        (spec.sparse_attention, "runs an ordinary dense target forward, as the reference; set sparse_attention=False"),
        (tuple(spec.inputs) != ("source",), "reads the source's layer inputs alone; set inputs='source'"),
        (spec.rotary, "translates residual streams, which hold no rotated keys; set rotary=False"),
        (cfg.linear_skip, "has no linear skip; set linear_skip=False"),
    )
    refuse("mot_h", refusals)


def replace_inputs(translator, source, target, source_cache, alignment, target_ids, mask, capacity, receiver, noise):
    """The target's dense forward over its context (a cache of `capacity` slots) with each window layer's
    input residual stream replaced by the translation of the source's (`source_read(layer_inputs=True)`), but at each
    row's first token, which keeps the target's own; (its cache, {"hidden": the mixture's aux outputs})."""
    spec = translator.spec
    batch, length = target_ids.shape
    streams = alignment_lib.resample(window_block(source_cache.k, spec.source_layers), alignment.weights)
    hidden, aux = translator.hidden(streams, mask)  # [B, T, W, Dt]
    first = first_valid_index(mask)
    firsts = Forward(target_ids[jnp.arange(batch), first][:, None])
    own = target.run_layers(firsts, hooks=[LayerInputs()]).records["inputs"]  # [Lt, B, 1, Dt]
    is_first = (jnp.arange(length) == first[:, None])[None, :, :, None]  # [1, B, T, 1]
    hidden = jnp.where(is_first, own[jnp.asarray(spec.target_layers)], hidden.transpose(2, 0, 1, 3))
    slot = np.full(target.config.num_layers, -1, np.int32)
    slot[list(spec.target_layers)] = np.arange(len(spec.target_layers))
    forward = Forward(target_ids, mask, fresh=True)
    cache = target.run_layers(forward, target.init_cache(batch, capacity), [ReplaceLayerInputs(hidden, slot)]).cache
    return cache, {"hidden": aux}


register(
    Kind(
        name="mot_h",
        # its target reads the context itself: its TTFT (translation) holds that forward
        label=lambda cfg: "MoT-h" if cfg.num_experts > 1 else "single translator (MoT-h)",
        build=lambda spec, cfg, rngs, dtype: {"hidden": MixtureOfTranslators(cfg, rngs=rngs, dtype=dtype)},
        translate=replace_inputs,
        check=check_spec,
        # the window layers' input residual streams, from the source's
        outputs=Outputs(
            "residual",
            "the window layers' input residual streams",
            lambda model: model.config.hidden_size,
            reads=LAYER_INPUTS,
            kv=False,
        ),
        torch={"hidden": "Mixture"},
        torch_call="translate_streams",
        recipe={"translator.mode": "replay", "translator.sparse_attention": False},  # the reference's dense forward
    )
)
