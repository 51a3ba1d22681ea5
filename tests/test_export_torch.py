"""The torch translator (mot_jax.export.torch_translator) against the JAX modules: mixtures, routers, whole window."""

import ast
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import MISSING
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import perturb
from safetensors import safe_open
from safetensors.numpy import save_file

from mot_jax.export import torch_translator
from mot_jax.export.weights import export, translator_config, translator_tensors
from mot_jax.jit import jit
from mot_jax.models import tiny
from mot_jax.models.hooks import Forward
from mot_jax.models.registry import FAMILIES, build_model
from mot_jax.translate import channels
from mot_jax.translate.align import align_batch
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator
from mot_jax.translate.window import translate_window

torch.set_default_dtype(torch.float32)
ATOL = 1e-4
# the JAX side, compiled (faster than eager on CPU, and the K and V mixtures of one translator share a compilation)
mixture_jax = jit(lambda mixture, x, mask: mixture(x, mask))
router_jax = jit(lambda mixture, x: mixture.router(x))
window_jax = jit(translate_window)
TEXTS = [
    "The expression returns an object; the statement raises an exception if the argument is not an integer.",
    "A class definition defines the attributes of the instance.",
]


@pytest.fixture(scope="module")
def models():
    """A tiny Llama (head_dim 16) and a tiny Gemma-3 with head_dim 8 (sliding layers: local RoPE), own tokenizers."""
    llama, _, llama_tok = tiny.load("random:llama")
    d = tiny.hf_config("random:gemma3") | dict(head_dim=8, query_pre_attn_scalar=8)
    gemma = build_model(FAMILIES[d["model_type"]][0].config_from_hf(d), seed=5)
    return {"llama": (llama, llama_tok), "gemma3": (gemma, tiny.tokenizer(d["vocab_size"]))}


def make(source, target, mode="replay", rotary=False, seed=0, **cfg):
    s, t = source.config, target.config
    spec = TranslationSpec.build(
        mode, channels.terminal(s.num_layers, t.num_layers, 0.5), s.num_layers, t.num_layers, rotary=rotary
    )
    cfg = dict(dict(dim=32, heads=4, depth=2, mlp_ratio=2, dispatch="dense", capacity_factor=8.0), **cfg)
    if rotary:
        cfg["output_activation"] = "none"
    config = TranslatorConfig(s.num_kv_heads * s.head_dim, t.num_kv_heads * t.head_dim, len(spec.target_layers), **cfg)
    translator = KVTranslator(spec, config, rngs=nnx.Rngs(seed))
    perturb(translator, seed + 1)
    return translator


def roundtrip(translator, source, target, folder):
    export(translator, source, target, folder)
    return torch_translator.KVTranslator.from_pretrained(folder)


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b.detach().numpy(), np.float64))))


MIXTURES = {  # name: (num_experts, top_k, fused_output, causal, output_activation, dispatch)
    "N1-fused-gelu": (1, 1, True, False, "gelu", "dense"),
    "N1-perlayer-none-causal": (1, 1, False, True, "none", "dense"),
    "N2k1-fused-gelu": (2, 1, True, False, "gelu", "dense"),
    "N2k1-perlayer-none-causal-sparse": (2, 1, False, True, "none", "sparse"),
    "N4k2-fused-none-causal": (4, 2, True, True, "none", "dense"),
    "N4k2-perlayer-gelu-sparse": (4, 2, False, False, "gelu", "sparse"),
}


@pytest.mark.parametrize("case", list(MIXTURES))
def test_mixtures_and_routers_match(case, models, tmp_path):
    experts, k, fused, causal, act, dispatch = MIXTURES[case]
    source, target = models["llama"][0], models["gemma3"][0]
    jt = make(
        source,
        target,
        num_experts=experts,
        top_k=k,
        fused_output=fused,
        causal=causal,
        output_activation=act,
        dispatch=dispatch,
        seed=len(case),
    )
    tt = roundtrip(jt, source, target, tmp_path)
    cfg = jt.cfg
    x = 1.5 * jax.random.normal(jax.random.key(7), (3, 11, cfg.window, cfg.source_width))
    mask = np.ones((3, 11), bool)
    mask[1, 8:], mask[2, :4] = False, False  # right and left padding
    diffs = {}
    for name in ("key", "value"):
        y, _ = mixture_jax(getattr(jt, name), x, jnp.asarray(mask))
        with torch.no_grad():
            xt, mt = torch.tensor(np.asarray(x)), torch.from_numpy(mask)
            diffs[name] = max_diff(y, getattr(tt, name)(xt, mt))
            if experts > 1:
                logits = router_jax(getattr(jt, name), x)
                diffs[name + ".router"] = max_diff(logits, getattr(tt, name).router(xt))
    print(f"\n[{case}] max |jax - torch|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert max(diffs.values()) < ATOL, diffs


def test_interlat_adapter_matches(models, tmp_path):
    """Widths that differ (the input projection), a head count that does not divide the width (6 -> 5 of 40), padding
    keys hidden, and scales large enough that the clip acts."""
    source, target = models["llama"][0], models["gemma3"][0]
    spec = TranslationSpec.build("direct", None, 4, 4, kind="interlat")
    jt = KVTranslator(spec, TranslatorConfig(12, 40, 4, kind="interlat", heads=6), rngs=nnx.Rngs(2))
    perturb(jt, seed=3)
    for name, value in (("scale", 1.5), ("output_scale", 3.0)):  # larger than at init, so some outputs clip
        getattr(jt.adapter, name).set_value(jnp.asarray(value))
    tt = roundtrip(jt, source, target, tmp_path)
    x = 3 * jax.random.normal(jax.random.key(7), (2, 9, 12))
    mask = np.ones((2, 9), bool)
    mask[1, 6:] = False
    y = jit(lambda adapter, x, mask: adapter(x, mask))(jt.adapter, x, jnp.asarray(mask))
    with torch.no_grad():
        got = tt.adapter(torch.tensor(np.asarray(x)), torch.from_numpy(mask))
    assert tt.adapter.heads == 5 and tt.adapter.input_proj is not None and np.abs(np.asarray(y)).max() == 10.0
    diff = max_diff(np.asarray(y)[mask], got[torch.from_numpy(mask)])
    print(f"\n[interlat adapter] max |jax - torch|: {diff:.2e}")
    assert diff < ATOL


def test_sparse_queues_over_capacity_match(models, tmp_path):
    """Queues longer than a small first capacity take a larger one in JAX (dropless); torch, dense, agrees."""
    source, target = models["llama"][0], models["gemma3"][0]
    jt = make(source, target, num_experts=4, top_k=2, dispatch="sparse", capacity_factor=0.5, seed=3)
    tt = roundtrip(jt, source, target, tmp_path)
    x = jax.random.normal(jax.random.key(8), (2, 16, jt.cfg.window, jt.cfg.source_width))
    mask = np.ones((2, 16), bool)
    mask[1, 12:] = False
    y, aux = mixture_jax(jt.key, x, jnp.asarray(mask))
    assert int(aux["stats"]["capacity"]) > jt.cfg.capacities(16)[0]
    with torch.no_grad():
        diff = max_diff(y, tt.key(torch.tensor(np.asarray(x)), torch.from_numpy(mask)))
    print(f"\n[sparse-overflow] max |jax - torch| {diff:.2e} ({int(aux['stats']['capacity'])} slots)")
    assert diff < ATOL


def encode(tokenizer, texts, left_pad_rows=(1,)):
    encoded = [e.ids for e in tokenizer.encode_batch(texts)]
    ids = np.zeros((len(encoded), max(map(len, encoded))), np.int32)
    mask = np.zeros(ids.shape, bool)
    for row, e in enumerate(encoded):
        span = slice(ids.shape[1] - len(e), None) if row in left_pad_rows else slice(0, len(e))
        ids[row, span], mask[row, span] = e, True
    return ids, mask


@pytest.fixture(scope="module")
def contexts(models):
    """Per direction: the source cache of real text, the alignment onto the target tokens, the target mask."""
    out = {}
    for src, tgt in [("llama", "gemma3"), ("gemma3", "llama")]:
        (source, source_tok), (_, target_tok) = models[src], models[tgt]
        ids, mask = encode(target_tok, TEXTS)
        source_ids, source_mask, alignment = align_batch(target_tok, source_tok, ids, mask)
        assert source_ids.shape[1] != ids.shape[1]  # the tokenizers differ: a real cross-tokenizer alignment
        cache = source.run_layers(Forward(jnp.asarray(source_ids), jnp.asarray(source_mask))).cache
        out[src, tgt] = cache, alignment, mask
    return out


# name: (source, target, mode, rotary, num_experts, top_k, fused_output, causal, output_activation, dispatch)
WINDOWS = {
    "replay-N1-fused-gelu": ("llama", "gemma3", "replay", False, 1, 1, True, False, "gelu", "dense"),
    "replay-N2k1-perlayer-causal-rotary": ("llama", "gemma3", "replay", True, 2, 1, False, True, "none", "sparse"),
    "replay-N4k2-fused-rotary": ("gemma3", "llama", "replay", True, 4, 2, True, False, "none", "dense"),
    "direct-N2k1-perlayer-causal-gelu": ("gemma3", "llama", "direct", False, 2, 1, False, True, "gelu", "sparse"),
    "direct-N4k2-fused-rotary": ("llama", "gemma3", "direct", True, 4, 2, True, False, "none", "dense"),
    "direct-N1-perlayer-rotary-causal": ("gemma3", "llama", "direct", True, 1, 1, False, True, "none", "dense"),
}


@pytest.mark.parametrize("case", list(WINDOWS))
def test_translate_window_matches(case, models, contexts, tmp_path):
    src, tgt, mode, rotary, experts, k, fused, causal, act, dispatch = WINDOWS[case]
    source, target = models[src][0], models[tgt][0]
    cache, alignment, mask = contexts[src, tgt]
    jt = make(
        source,
        target,
        mode,
        rotary,
        num_experts=experts,
        top_k=k,
        fused_output=fused,
        causal=causal,
        output_activation=act,
        dispatch=dispatch,
        linear_skip=mode == "direct",
        seed=len(case),
    )
    k_jax, v_jax, _ = window_jax(jt, source, target, cache, alignment, jnp.asarray(mask))
    tt = roundtrip(jt, source, target, tmp_path)
    assert tt.config.apply_rotary == rotary
    per_layer = [torch.tensor(np.asarray(layer)) for layer in cache.k]  # transformers' per-layer layout
    stacked_v = torch.tensor(np.asarray(cache.v))
    weights, positions = np.array(alignment.weights), torch.tensor(np.asarray(cache.positions))
    with torch.no_grad():
        k_t, v_t = tt.translate_window(
            per_layer, stacked_v, torch.from_numpy(weights), torch.from_numpy(mask), source_positions=positions
        )
        k_default, _ = tt.translate_window(per_layer, stacked_v, weights, mask)  # right-padded source: 0..S-1
    assert tuple(k_t.shape) == k_jax.shape == (len(jt.spec.target_layers), *k_jax.shape[1:])
    assert k_jax.shape[2:] == (target.config.num_kv_heads, mask.shape[1], target.config.head_dim)
    diffs = {"k": max_diff(k_jax, k_t), "v": max_diff(v_jax, v_t), "k(default positions)": max_diff(k_jax, k_default)}
    print(f"\n[{case}] max |jax - torch|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert max(diffs.values()) < ATOL, diffs


@pytest.mark.parametrize(
    "src, tgt, mode, rotary, act",
    [("llama", "gemma3", "direct", True, "none"), ("gemma3", "llama", "replay", False, "gelu")],
)
def test_projector_window_matches(src, tgt, mode, rotary, act, models, contexts, tmp_path):
    """The C2C-Project baseline (kind="projector") exports as per-layer MLPs with the same window translation."""
    source, target = models[src][0], models[tgt][0]
    cache, alignment, mask = contexts[src, tgt]
    jt = make(source, target, mode, rotary, kind="projector", output_activation=act, linear_skip=rotary, seed=11)
    k_jax, v_jax, _ = window_jax(jt, source, target, cache, alignment, jnp.asarray(mask))
    tt = roundtrip(jt, source, target, tmp_path)
    assert isinstance(tt.key, torch_translator.Projector) and tt.config.kind == "projector"
    with torch.no_grad():
        k_t, v_t = tt.translate_window(
            torch.tensor(np.asarray(cache.k)),
            torch.tensor(np.asarray(cache.v)),
            np.array(alignment.weights),
            mask,
            source_positions=torch.tensor(np.asarray(cache.positions)),
        )
    diffs = {"k": max_diff(k_jax, k_t), "v": max_diff(v_jax, v_t)}
    print(f"\n[projector-{mode}] max |jax - torch|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert max(diffs.values()) < ATOL, diffs


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory):
    source, target = models["llama"][0], models["gemma3"][0]
    translator = make(source, target, rotary=True, num_experts=2, top_k=1)
    return export(translator, source, target, tmp_path_factory.mktemp("exported")), translator, (source, target)


def test_export_is_json_and_safetensors_only(exported):
    folder, translator, models = exported
    assert sorted(p.name for p in folder.iterdir()) == [".mot_jax_output", "config.json", "model.safetensors"]
    assert json.loads((folder / ".mot_jax_output").read_text())["files"] == ["config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert config["source_layers"] == list(translator.spec.source_layers) and config["num_experts"] == 2
    assert config["source_kv_heads"] == 2 and config["target_head_dim"] == 8
    raw = (folder / "model.safetensors").read_bytes()
    header = int.from_bytes(raw[:8], "little")
    assert raw[8:9] == b"{" and json.loads(raw[8 : 8 + header])  # a safetensors header, not a pickle stream
    assert not raw.startswith(b"\x80") and b"PK\x03\x04" not in raw[:4]
    with safe_open(str(folder / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
        assert "key.experts.blocks.in_proj.kernel" in names and "value.router.hidden.kernel" in names
        assert f.get_tensor("rope.target_inv_freq").shape == (4, 4)
        assert f.get_tensor("key.experts.blocks.in_proj.kernel").shape == (2, 2 * translator.cfg.window, 32, 96)
    assert names == set(translator_tensors(translator, *models)) >= {"rope.source_inv_freq", "rope.target_inv_freq"}
    module = torch_translator.KVTranslator.from_pretrained(folder)
    assert names == set(module.state_dict()) and not module.training
    assert torch_translator.TorchTranslatorConfig.from_dict(config) == module.config


def test_config_is_plain_json(models):
    source, target = models["llama"][0], models["gemma3"][0]
    translator = make(source, target, mode="direct", num_experts=1, top_k=1)
    config = translator_config(translator, source.config, target.config)  # configs work as well as models
    assert json.loads(json.dumps(config)) == config
    assert config["mode"] == "direct" and config["target_layers"] == [0, 1, 2, 3] and config["target_rotary"]
    names = translator_tensors(translator)
    assert "key.router.out.kernel" not in names and all(v.dtype == np.float32 for v in names.values())


def test_torch_config_mirrors_the_jax_fields_and_defaults():
    # every field every JAX translator has (a kind's own travel in `options`), name -> default (MISSING: required)
    jax_fields = {f.name: f.default for cls in (TranslatorConfig, TranslationSpec) for f in dataclasses.fields(cls)}
    torch_fields = {f.name: f.default for f in dataclasses.fields(torch_translator.TorchTranslatorConfig)}
    assert jax_fields.keys() <= torch_fields.keys()
    # and the torch side adds the models' cache shapes, which translator_config writes beside the fields, and what
    # the kind declares it builds, calls and reads (`Kind.torch`, `torch_call`, the spec's read)
    shapes = {f"{side}_{name}" for side in ("source", "target") for name in ("num_layers", "kv_heads", "head_dim")}
    shapes |= {"source_rotary", "target_rotary", "target_hidden_size", "source_hidden_size"}
    declared = {"modules", "call", "source_reads", "kv_from_hidden"}
    assert torch_fields.keys() - jax_fields.keys() == shapes | declared
    jax_fields["options"] = torch_fields["options"] = MISSING  # a tuple of pairs in JAX, a dict in the JSON
    shared = jax_fields.keys() & torch_fields.keys()
    defaulted = {n for n in shared if jax_fields[n] is not MISSING}
    defaults = lambda fields: {n: fields[n] for n in defaulted}
    assert defaults(torch_fields) == defaults(jax_fields)
    # required in JAX and given a default in torch (every export writes them): the replay's mode and layer map
    required = lambda fields: {n for n in shared if fields[n] is MISSING}
    assert required(jax_fields) - required(torch_fields) == {"mode", "layer_map"}
    assert not required(torch_fields) - required(jax_fields)


def test_an_export_of_format_version_1_loads_as_today(exported, tmp_path):
    """Version 1 named its kind only and wrote the kind's own fields at the top; it loads to today's config."""
    folder = exported[0]
    today = json.loads((folder / "config.json").read_text())
    declared = ("modules", "call", "source_reads", "kv_from_hidden", "options")
    old = {k: v for k, v in today.items() if k not in declared} | {"format_version": 1}
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    loaded = torch_translator.KVTranslator.from_pretrained(tmp_path)
    assert loaded.config == torch_translator.TorchTranslatorConfig.from_dict(today)
    lsc = torch_translator.TorchTranslatorConfig.upgrade_v1({"kind": "lsc", "shared_slots": 3, "shared_dim": 4})
    assert lsc["options"] == {"shared_slots": 3, "shared_dim": 4} and lsc["modules"]["key"] == "LatentTranslator"
    residual = torch_translator.TorchTranslatorConfig.upgrade_v1({"kind": "mot_h", "outputs": "residual"})
    assert (residual["source_reads"], residual["call"], residual["modules"]) == (
        "layer_inputs",
        "translate_streams",
        {"hidden": "Mixture"},
    )


def test_load_errors(exported, tmp_path):
    folder = exported[0]
    load = torch_translator.KVTranslator.from_pretrained
    with pytest.raises(ValueError, match="config.json does not exist"):
        load(tmp_path)
    with safe_open(str(folder / "model.safetensors"), framework="np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    cases = {
        "lacks tensor 'key.router.out.bias'": {k: v for k, v in tensors.items() if k != "key.router.out.bias"},
        "holds tensor 'extra.weight'": tensors | {"extra.weight": np.zeros(3, np.float32)},
        "'value.experts.input_proj.kernel' .* has shape": tensors
        | {"value.experts.input_proj.kernel": np.zeros((2, 32, 33), np.float32)},
    }
    for i, (message, changed) in enumerate(cases.items()):
        broken = tmp_path / f"broken{i}"
        broken.mkdir()
        (broken / "config.json").write_text((folder / "config.json").read_text())
        save_file(changed, str(broken / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            load(broken)
    (broken / "model.safetensors").write_bytes(b"\x80\x04not safetensors")
    with pytest.raises(ValueError, match="Cannot read"):
        load(broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load(broken)
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="top_k=3"):
        torch_translator.TorchTranslatorConfig.from_dict(config | {"top_k": 3})


def test_torch_module_imports_no_jax():
    path = Path(torch_translator.__file__)
    tree = ast.parse(path.read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots <= set(sys.stdlib_module_names) | {"torch", "safetensors", "__future__"}, roots
    assert "pickle" not in roots and "torch.load(" not in path.read_text()
    code = (
        "import sys; import mot_jax.export.torch_translator; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax')]; "
        "assert not bad, bad"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
