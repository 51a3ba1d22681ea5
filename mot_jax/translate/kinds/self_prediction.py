"""Self-prediction (`kind="self_prediction"`; SwiftKV's SingleInputKV with self-distillation, arXiv 2410.03960,
snowflakedb/ArcticTraining `projects/swiftkv`): the target writes its own upper layers' K/V from one state of its
own and learns to read them. No source model is read: the cost it saves is the target's own upper layers over the
context.

- The target runs its own bottom `native_bottom` = B layers over the context. For each layer l >= B a linear map of
  its RMS-normed residual stream after layer B writes layer l's input, and layer l's own frozen norm, K/V
  projections and RoPE make its K/V from it (`outputs="hidden"`, the window path). With the identity map this is
  SwiftKV's start (each upper layer's own W_K, W_V on the one state); here the map starts at the least-squares fit
  of the layers' native inputs (the linear skip), which the identity can only match or trail, and trains from there.
- The receiver adapts: each layer l >= B reads with a trained low-rank change to its query projection
  (`receiver_rank`, `mot_jax/translate/receiver.py`), where SwiftKV trains full copies of those projections.
- New tokens (`new_tokens_from_map`, this kind's own field; the recipe turns it on, saved runs from before it have it
  off): every token the target reads or writes after the context, the question and the answer, the prompt of the
  training loss, each decoded token, makes its K/V at layers l >= B the same way: the same map of its own layer-B
  state (its own bottom layers' output) writes layer l's key and value inputs, and layer l's norm, K/V projections
  and RoPE at the token's position make the K/V it caches and attends with (`translate/hooks.py:MappedKeyValues`,
  run by `KVTranslator.receiver`'s reader). SwiftKV does this for every token, prompt and generated alike
  (ArcticTraining's `modeling_llama_swiftkv.py`: each forward, decode steps included, computes the upper layers'
  `k_proj_swiftkv` / `v_proj_swiftkv` of `norm_swiftkv` of the layer-B state), so that its training and inference
  agree and no upper layer's K/V needs that layer's own input. Off, those tokens compute their upper K/V as the
  target does (from each layer's own input), with the adapted queries.
- The loss (the recipe): KL at temperature 2 to the target reading its native cache, at the labelled prompt
  positions (the answers of question-shaped rows, every token of plain continuations), plus the relative error of
  the final hidden states there; no K/V MSE, no CE.

Differences from SwiftKV: its K/V maps project the normed layer-B state to K/V directly (one norm of its own), where
these write each layer's input for its own norm and projections; its training data are instruction/chat sets at
billions of tokens, here the offline corpus's rows on a CPU.
"""

from __future__ import annotations

from mot_jax.translate.hooks import MappedKeyValues
from mot_jax.translate.kinds.linear import build as linear_build
from mot_jax.translate.kinds.registry import Kind, refuse, register


def check(spec, cfg):
    refuse(
        "self_prediction",
        [
            (spec.mode != "direct", "writes the target's upper layers over the context; set mode='direct'"),
            (spec.inputs != ("hidden",), "reads the target's residual stream alone; set inputs='hidden'"),
            (spec.outputs != "hidden", "writes layer inputs for the target's own projections; set outputs='hidden'"),
            (not cfg.linear_skip, "is a linear map per layer (the linear skip); set linear_skip=True"),
        ],
    )


def reader_hook(translator):
    """With `new_tokens_from_map`, the reader's hook: every new token's K/V at the written layers from the same maps
    of its own state before them (None: off)."""
    if not translator.cfg.new_tokens_from_map:
        return None
    return MappedKeyValues(translator.key_skip, translator.value_skip, translator.spec.native_bottom)


register(
    Kind(
        name="self_prediction",
        label=lambda cfg: "self-prediction (SwiftKV)",
        build=linear_build,  # the linear kind's modules: the least-squares-started maps are the prediction
        check=check,
        reader_hook=reader_hook,
        fields=dict(new_tokens_from_map=False),  # off: saved runs from before it read as they were trained
        recipe={
            "translator.mode": "direct",
            "translator.linear_skip": True,
            "translator.output_activation": "none",
            "translator.inputs": "hidden",
            "translator.outputs": "hidden",
            # a configuration that runs on any target of 3 layers or more; experiment configs set their own B
            "translator.native_bottom": 2,
            "translator.receiver_rank": 16,
            "translator.new_tokens_from_map": True,  # SwiftKV's: new tokens' upper K/V from their layer-B state
            "loss.ce_weight": 0.0,
            "loss.correction_weight": 0.0,
            "loss.distill_weight": 1.0,
            "loss.distill_temperature": 2.0,
            "loss.hidden_weight": 1.0,
        },
        torch={"key": "NoMixture", "value": "NoMixture"},
        no_export="the target's adapted query projections are not carried by the PyTorch side yet",
    )
)
