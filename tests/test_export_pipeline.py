"""The exported translator driving Hugging Face transformers models: caches and greedy tokens equal mot_jax's."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from flax import nnx
from helpers import NEW_TOKENS, TEXT, assert_hf_cache_and_generation, hf_model, jax_greedy, perturb

from mot_jax.errors import MotJaxError
from mot_jax.export import weights
from mot_jax.export.torch_pipeline import CachePipeline
from mot_jax.export.torch_translator import KVTranslator as TorchKVTranslator
from mot_jax.models import tiny
from mot_jax.translate import channels
from mot_jax.translate.pipeline import CacheTranslator
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    return {name: hf_model(name, tmp) for name in ("random:llama", "random:gemma3")}


@pytest.mark.parametrize("mode", ["replay", "direct"])
@pytest.mark.parametrize("pair", [("random:llama", "random:gemma3"), ("random:gemma3", "random:llama")])
def test_transformers_generation_from_the_exported_translation_equals_mot_jax(models, pair, mode, tmp_path):
    """Both directions: a Gemma-3 source has sliding layers (window 32 < the 56-token context)."""
    source_side, target_side = models[pair[0]], models[pair[1]]
    spec = TranslationSpec.build(mode, channels.terminal(4, 4, 0.5), 4, 4, k_attn=4, dense_bottom=1)
    sizes = dict(dim=32, heads=4, depth=1, mlp_ratio=2, num_experts=2, dispatch="dense")
    cfg = mixture_config(spec, source_side[0], target_side[0], **sizes)
    assert_exported_serves_as_mot_jax(KVTranslator(spec, cfg, rngs=nnx.Rngs(3)), source_side, target_side, tmp_path)


def assert_exported_serves_as_mot_jax(translator, source_side, target_side, tmp_path):
    """The exported translator in `CachePipeline` gives mot_jax's cache of TEXT and its greedy tokens after it."""
    (source, source_hf, source_tok), (target, target_hf, target_tok) = source_side, target_side
    ids = np.asarray([target_tok.encode(TEXT).ids], np.int32)
    mask = np.ones(ids.shape, bool)
    suffix = np.asarray([target_tok.encode(" Who counts ships?").ids], np.int32)

    jax_cache = CacheTranslator(source, target, source_tok, target_tok, translator).from_target_ids(
        ids, mask, capacity=ids.shape[1] + suffix.shape[1] + NEW_TOKENS
    )
    expected = jax_greedy(target, jax_cache, suffix)

    weights.export(translator, source, target, tmp_path / "exported")
    pipe = CachePipeline(
        source_hf, target_hf, source_tok, target_tok, TorchKVTranslator.from_pretrained(tmp_path / "exported")
    )
    cache = pipe.from_target_ids(ids, mask)
    assert_hf_cache_and_generation(target_hf, cache, jax_cache, ids, suffix, expected)


DIRECT = {  # name: (kind, native_bottom, inputs, outputs); the first is the project's best operating point
    "linear-B2-source,embeddings,hidden": ("linear", 2, ("source", "embeddings", "hidden"), "kv"),
    "mot+skip-B1-embeddings,hidden-to-hidden": ("mot", 1, ("embeddings", "hidden"), "hidden"),
    "lsc": ("lsc", 0, ("source",), "kv"),
}


@pytest.mark.parametrize("case", list(DIRECT))
def test_the_dials_switches_and_lsc_serve_in_transformers_as_in_mot_jax(models, case, tmp_path):
    """The dial's switches (the target's own bottom layers, its embeddings and residual stream as inputs, layer
    inputs as outputs), the linear skip alone, and LSC: the pipeline's cache equals mot_jax's, greedy tokens too."""
    kind, bottom, inputs, outputs = DIRECT[case]
    source, target = models["random:llama"][0], models["random:gemma3"][0]
    ls, lt = source.config.num_layers, target.config.num_layers
    spec = TranslationSpec.build(
        "direct", None, ls, lt, native_bottom=bottom, inputs=inputs, outputs=outputs, kind=kind
    )
    sizes = dict(dim=32, heads=4, depth=1, mlp_ratio=2, num_experts=2, dispatch="dense")
    sizes |= dict(shared_slots=4, shared_dim=8) if kind == "lsc" else {}
    cfg = mixture_config(spec, source, target, kind=kind, linear_skip=kind != "lsc", **sizes)
    translator = KVTranslator(spec, cfg, rngs=nnx.Rngs(3))
    perturb(translator, seed=4)  # the linear skip starts at zero
    assert_exported_serves_as_mot_jax(translator, models["random:llama"], models["random:gemma3"], tmp_path)


@pytest.mark.parametrize("kind", ["interlat", "mot_h"])
@pytest.mark.parametrize("pair", [("random:llama", "random:gemma3"), ("random:gemma3", "random:llama")])
def test_interlat_and_mot_h_serve_in_transformers_as_in_mot_jax(models, kind, pair, tmp_path):
    """Interlat's latents as the target's `inputs_embeds` (a Gemma-3 target scales its own token embedding, a Llama
    one does not) and MoT-h's window-layer inputs replaced by forward pre-hooks: the cache equals mot_jax's, greedy
    tokens too."""
    translator = baseline(kind, models[pair[0]][0], models[pair[1]][0])
    assert_exported_serves_as_mot_jax(translator, models[pair[0]], models[pair[1]], tmp_path)


def baseline(kind, source, target):
    """A small Interlat adapter or MoT-h mixture (over the top half of the target's layers), perturbed."""
    ls, lt = source.config.num_layers, target.config.num_layers
    if kind == "interlat":
        spec, sizes = TranslationSpec.build("direct", None, ls, lt, kind="interlat"), dict(heads=4)
    else:
        spec = TranslationSpec.build(
            "replay", channels.terminal(ls, lt, 0.5), ls, lt, kind="mot_h", sparse_attention=False
        )
        sizes = dict(dim=32, heads=4, depth=1, mlp_ratio=2, num_experts=2, dispatch="dense")
    translator = KVTranslator(spec, mixture_config(spec, source, target, kind=kind, **sizes), rngs=nnx.Rngs(3))
    perturb(translator, seed=4)  # LayerNorms and zero biases off their init values
    return translator


def test_what_the_pytorch_side_cannot_serve_is_refused_in_one_line(models):
    source, target = models["random:llama"][0], models["random:gemma3"][0]
    spec = TranslationSpec.build("direct", None, 4, 4, native_bottom=4)
    translator = KVTranslator(spec, mixture_config(spec, source, target, dim=32, heads=4), rngs=nnx.Rngs(0))
    with pytest.raises(MotJaxError, match="native_bottom=4 is every target layer: nothing is translated"):
        weights.translator_config(translator, source, target)
    gpt2 = tiny.load("random:gpt2")[0]
    spec = TranslationSpec.build("direct", None, 4, 4, native_bottom=1, outputs="hidden")
    translator = KVTranslator(spec, mixture_config(spec, source, gpt2, dim=32, heads=4), rngs=nnx.Rngs(0))
    with pytest.raises(MotJaxError, match="outputs='hidden' covers rotary targets .* not 'gpt2'"):
        weights.translator_config(translator, source, gpt2)


def test_export_command_writes_the_trained_translator(tiny_run, tmp_path):
    from safetensors import safe_open

    from mot_jax.errors import MotJaxError
    from mot_jax.export.__main__ import export_workdir
    from mot_jax.training.trained import load_trained

    run = shutil.copytree(tiny_run[0], tmp_path / "run")  # quickstart:tiny, 2 steps (a copy: it must stay as is)
    out, trained = export_workdir(run, tmp_path / "exported")
    assert sorted(p.name for p in out.iterdir()) == [".mot_jax_output", "config.json", "model.safetensors"]
    files = sorted(p.relative_to(tmp_path) for p in run.rglob("*"))
    with pytest.raises(MotJaxError, match="is a training workdir"):  # it deleted the workdir
        export_workdir(run, run)
    assert sorted(p.relative_to(tmp_path) for p in run.rglob("*")) == files
    config = json.loads((out / "config.json").read_text())
    assert (config["source"], config["target"], config["step"]) == ("random:llama", "random:gemma3", 2)
    with safe_open(str(out / "model.safetensors"), "np") as f:
        saved = {name: f.get_tensor(name) for name in f.keys()}
    params = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(trained.translator))}
    assert saved.keys() == params.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(saved[name], value)
    assert trained.step == load_trained(run, "best").step == 2
    TorchKVTranslator.from_pretrained(out)  # loads with torch alone


def test_export_refuses_a_workdir_without_a_finished_checkpoint(tmp_path):
    from mot_jax.errors import MotJaxError
    from mot_jax.export.__main__ import export_workdir

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(MotJaxError, match="holds no finished checkpoint"):
        export_workdir(tmp_path / "run", tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


def test_the_transformers_pipeline_imports_no_jax():
    import subprocess
    import sys

    code = (
        "import sys, mot_jax.export.torch_pipeline; assert not {'jax', 'flax'} & set(sys.modules), sys.modules.keys()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sparse-replay", "linear-B8-source,embeddings,hidden"])
def test_offline_real_pair_in_transformers_equals_mot_jax(method, tmp_path):
    """SmolLM2-135M -> Gemma-3-270M (the folders mot_jax converted the GGUF files into, found by `from_export`),
    sparse replay and the dial's best operating point (the target's 8 bottom layers native)."""
    from mot_jax.models.gguf import load_tokenizer
    from mot_jax.models.loading import load_model

    names = ("smollm2-135m", "gemma3-270m")
    (source, target), (source_tok, target_tok) = [load_model(n)[0] for n in names], [load_tokenizer(n) for n in names]
    if method == "sparse-replay":
        spec = TranslationSpec.build("replay", channels.terminal(30, 18, 0.3), 30, 18)
        cfg = mixture_config(spec, source, target, dim=64, heads=4, depth=1)
    else:
        spec = TranslationSpec.build("direct", None, 30, 18, native_bottom=8, inputs=("source", "embeddings", "hidden"))
        cfg = mixture_config(spec, source, target, kind="linear", linear_skip=True)
    translator = KVTranslator(spec, cfg, rngs=nnx.Rngs(0))
    if method != "sparse-replay":
        perturb(translator, seed=1, scale=0.02)  # the linear skip starts at zero
    ids = np.asarray([target_tok.encode(TEXT).ids], np.int32)
    suffix = np.asarray([target_tok.encode(" Question: Who counts ships? Answer:", add_special_tokens=False).ids])
    capacity = ids.shape[1] + suffix.shape[1] + NEW_TOKENS
    ct = CacheTranslator(source, target, source_tok, target_tok, translator)
    expected = jax_greedy(target, ct.from_target_ids(ids, np.ones(ids.shape, bool), capacity=capacity), suffix)
    extra = dict(source=names[0], target=names[1], dtype="float32")  # as python -m mot_jax.export names them
    pipe = CachePipeline.from_export(weights.export(translator, source, target, tmp_path / "exported", extra))
    cache = pipe.from_target_ids(ids, np.ones(ids.shape, bool))
    full = torch.as_tensor(np.concatenate([ids, suffix], 1), dtype=torch.long)
    out = pipe.target.generate(
        full, attention_mask=torch.ones_like(full), cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False
    )
    got = out[0, full.shape[1] :].tolist()
    assert got == expected[: len(got)] and len(got) >= NEW_TOKENS // 2, (got, expected)


SHORT = "Ships pass at dawn."


@pytest.mark.parametrize("method", ["replay", "direct", "interlat", "mot_h"])
def test_every_row_of_a_mixed_length_batch_generates_as_it_does_alone(models, method, tmp_path):
    """from_text([short, long]) then one generate call: each row's greedy tokens equal that text's single-row run
    (a Gemma-3 target: its sliding layers keep only the last slots of the padded batch)."""
    (source, source_hf, source_tok), (target, target_hf, target_tok) = models["random:llama"], models["random:gemma3"]
    if method in ("interlat", "mot_h"):
        translator = baseline(method, source, target)
    else:
        spec = TranslationSpec.build(method, channels.terminal(4, 4, 0.5), 4, 4, k_attn=4, dense_bottom=1)
        sizes = dict(dim=32, heads=4, depth=1, mlp_ratio=2, num_experts=2, dispatch="dense")
        translator = KVTranslator(spec, mixture_config(spec, source, target, **sizes), rngs=nnx.Rngs(3))
    weights.export(translator, source, target, tmp_path / "exported")
    pipe = CachePipeline(
        source_hf, target_hf, source_tok, target_tok, TorchKVTranslator.from_pretrained(tmp_path / "exported")
    )
    question = torch.as_tensor([target_tok.encode(" Who counts ships?", add_special_tokens=False).ids])

    def greedy(texts):
        cache, ids, mask = pipe.from_text(texts)
        asked = question.expand(len(texts), -1)
        full = torch.cat([ids, asked], 1)
        out = target_hf.generate(
            input_ids=full,
            attention_mask=torch.cat([mask, torch.ones_like(asked)], 1),
            cache=cache,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
        return out[:, full.shape[1] :].tolist()

    texts = [SHORT, TEXT]
    assert len(target_tok.encode(SHORT).ids) < len(target_tok.encode(TEXT).ids) - 20
    batched = greedy(texts)
    for row, text in enumerate(texts):
        assert batched[row] == greedy([text])[0], (row, batched, greedy([text]))


def test_from_export_loads_the_models_and_tokenizers_its_config_names(models, tmp_path, monkeypatch):
    """The export's config names the source by its folder and the target as an embedded model, which mot_jax
    converted into `$MOT_JAX_CACHE/<name>-<key>/`: `from_export` builds the pipeline that its constructor builds from
    those models, tokenizers and translator. `random:` names have no folder; `source=` / `target=` replace names."""
    (source, source_hf, source_tok), (target, target_hf, target_tok) = models["random:llama"], models["random:gemma3"]
    cache_root = tmp_path / "cache"
    monkeypatch.setenv("MOT_JAX_CACHE", str(cache_root))
    converted = cache_root / "gemma3-270m-0123456789ab"
    shutil.copytree(target_hf.name_or_path, converted)
    gguf_file = tmp_path / "gemma.gguf"  # the GGUF file it was converted from
    gguf_file.touch()
    (converted / "manifest.json").write_text(json.dumps(dict(source=str(gguf_file))))  # written last: it finished
    (cache_root / "gemma3-270m-ba9876543210").mkdir()  # a conversion that did not finish: passed over
    gone = cache_root / "gemma3-270m-ffffffffffff"  # a newer one of another install, since removed: passed over
    gone.mkdir()
    (gone / "manifest.json").write_text(json.dumps(dict(source=str(tmp_path / "removed" / "gemma.gguf"))))
    os.utime(converted / "manifest.json", (1e9, 1e9))
    spec = TranslationSpec.build("replay", channels.terminal(4, 4, 0.5), 4, 4, k_attn=4, dense_bottom=1)
    cfg = mixture_config(spec, source, target, dim=32, heads=4, depth=1, mlp_ratio=2, num_experts=2, dispatch="dense")
    translator = KVTranslator(spec, cfg, rngs=nnx.Rngs(3))
    names = dict(source=source_hf.name_or_path, target="gemma3-270m", dtype="float32")
    pipe = CachePipeline.from_export(weights.export(translator, source, target, tmp_path / "exported", names))
    assert (Path(pipe.source.name_or_path), Path(pipe.target.name_or_path)) == (Path(source_hf.name_or_path), converted)
    assert not (pipe.source.training or pipe.target.training) and pipe.target.dtype == torch.float32
    by_hand = CachePipeline(
        source_hf, target_hf, source_tok, target_tok, TorchKVTranslator.from_pretrained(tmp_path / "exported")
    )
    (cache, ids, mask), (want, want_ids, want_mask) = pipe.from_text([SHORT, TEXT]), by_hand.from_text([SHORT, TEXT])
    assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask)
    for layer, want_layer in zip(cache.layers, want.layers, strict=True):
        torch.testing.assert_close(layer.keys, want_layer.keys, rtol=0, atol=0)
        torch.testing.assert_close(layer.values, want_layer.values, rtol=0, atol=0)

    random_names = weights.export(translator, source, target, tmp_path / "random", dict(source="random:llama"))
    with pytest.raises(ValueError, match="tiny random mot_jax model"):
        CachePipeline.from_export(random_names)
    with pytest.raises(ValueError, match="names no target model"):
        CachePipeline.from_export(random_names, source=source_hf.name_or_path)
    with pytest.raises(ValueError, match="neither a folder, a model converted into .* nor a hub id"):
        CachePipeline.from_export(random_names, source="no-such-model", target=str(converted))  # the hub is off
    pipe = CachePipeline.from_export(random_names, source=source_hf.name_or_path, target="gemma3-270m")
    assert Path(pipe.target.name_or_path) == converted


def test_export_and_evaluation_refuse_a_checkpoint_with_non_finite_weights(tiny_run, tmp_path, monkeypatch):
    """A NaN checkpoint was exported as NaN tensors and evaluated to F1 0.000 with exit 0."""
    import jax

    from mot_jax.export.__main__ import export_workdir
    from mot_jax.training import trained as trained_lib

    restore = trained_lib.Checkpoints.restore

    def diverged(self, *args):  # the checkpoint as a run that diverged before saving it would have written it
        restored = restore(self, *args)
        return dict(restored, params=jax.tree.map(lambda p: p * np.nan, restored["params"]))

    monkeypatch.setattr(trained_lib.Checkpoints, "restore", diverged)
    refused = f"The checkpoint of step 2 in {tiny_run[0]} holds non-finite weights"
    with pytest.raises(MotJaxError, match=refused):
        export_workdir(tiny_run[0], tmp_path / "exported")
    with pytest.raises(MotJaxError, match=refused):
        trained_lib.load_trained(tiny_run[0], "best")  # what evaluate loads
    assert not list(tmp_path.iterdir())
