"""The model families and how a checkpoint directory becomes one of our Flax models, and back.

`FAMILIES` maps an HF `model_type` to its family module (config reading, tensor-name table) and model class. Every
tensor goes through the family's mapping table and is shape-checked; a missing, unexpected, unreadable or
mis-shaped tensor is a `MotJaxError` that names it. Which name means which model (tiny, GGUF, hub id) is
`mot_jax.models.loading`'s business; this module only knows directories and tensors.

Given a mesh, every weight is created directly in its sharding (`mot_jax.sharding`'s rules on its logical axis
names): the model is built abstractly, each tensor is read (and stacked over layers) on the host, and each device
receives only its own slice of it; no device ever holds a whole weight it should hold a part of.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mot_jax import sharding
from mot_jax.errors import MotJaxError
from mot_jax.models import decoder, gemma3, gpt2, llama, opt, qwen2, qwen3
from mot_jax.models.base import ModelConfig
from mot_jax.models.mapping import to_hf_state_dict

# model_type in config.json -> (family module, model class)
FAMILIES = {
    "gpt2": (gpt2, gpt2.GPT2),
    "opt": (opt, opt.OPT),
    "qwen2": (qwen2, decoder.RotaryLM),
    "qwen3": (qwen3, decoder.RotaryLM),
    "llama": (llama, decoder.RotaryLM),
    "gemma3_text": (gemma3, decoder.RotaryLM),
}
# cfg.family -> (family module, model class)
FAMILY_BY_NAME = {module.__name__.rsplit(".", 1)[1]: (module, cls) for module, cls in FAMILIES.values()}
# Tensors in checkpoints that are not parameters: causal-mask buffers (old GPT-2), cached RoPE frequencies.
IGNORED = (r"\.attn\.(bias|masked_bias)$", r"rotary_emb\.inv_freq$")
# config.json integers that shape a model, in every family's naming (absent or null: the family's default)
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    "n_embd",
    "n_head",
    "n_layer",
    "n_inner",
    "n_positions",
    "ffn_dim",
    "word_embed_proj_dim",
    "sliding_window_pattern",
)
DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def resolve_dtype(dtype):
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise MotJaxError(f"Unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
        return DTYPES[dtype]
    return dtype


def check_shape_fields(d: dict, where):
    """Each model-shaping integer of an HF config dict (read from `where`) is a positive integer, and the query
    heads split evenly over the key/value heads; otherwise one MotJaxError naming the file and the field."""
    for field in SHAPE_FIELDS:
        value = d.get(field)
        if value is not None and (type(value) is not int or value < 1):
            raise MotJaxError(
                f"{where}: {field} is {json.dumps(value)}, it must be a positive integer; fix that field (or restore "
                "the checkpoint's original config.json)."
            )
    heads, kv_heads = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise MotJaxError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}; fix one of "
            "them."
        )


def read_config(model_dir: Path) -> tuple[dict, ModelConfig]:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise MotJaxError(f"{model_dir} has no config.json; pass a Hugging Face checkpoint directory.")
    try:
        d = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise MotJaxError(f"{config_path} is not valid JSON ({e}); restore it from the original checkpoint.") from None
    if not isinstance(d, dict):
        raise MotJaxError(f"{config_path} is not a JSON object; restore it from the original checkpoint.")
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        raise MotJaxError(
            f"Architecture {model_type!r} in {config_path} is not supported; supported: {', '.join(FAMILIES)}."
        )
    check_shape_fields(d, config_path)
    try:
        return d, FAMILIES[model_type][0].config_from_hf(d)
    except KeyError as e:
        raise MotJaxError(f"{config_path} lacks the field {e.args[0]!r} that a {model_type} config needs.") from None


class TensorSource:
    """Access to a checkpoint's tensors by HF name: in memory (`from_arrays`) or read lazily from a directory
    (`from_dir`: safetensors, sharded or not; or pytorch_model.bin). Names are looked up without the base-model
    prefix ("transformer.", "model."), which some checkpoints omit."""

    def __init__(self, names, base_prefix: str, arrays=None, files=None):
        self.arrays, self.files = arrays or {}, files or {}
        self.by_name = {(n[len(base_prefix) :] if n.startswith(base_prefix) else n): n for n in names}
        self.prefix = base_prefix if any(n.startswith(base_prefix) for n in names) else ""
        self._open = {}

    @classmethod
    def from_arrays(cls, tensors: dict[str, np.ndarray], base_prefix: str):
        return cls(list(tensors), base_prefix, arrays=tensors)

    @classmethod
    def from_dir(cls, model_dir: Path, base_prefix: str):
        index, single = model_dir / "model.safetensors.index.json", model_dir / "model.safetensors"
        if index.is_file():
            files = {name: model_dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        elif single.is_file():
            files = {name: single for name in cls._safetensors_keys(single)}
        elif list(model_dir.glob("pytorch_model*.bin")):
            return cls.from_arrays(cls._load_torch_bins(sorted(model_dir.glob("pytorch_model*.bin"))), base_prefix)
        else:
            raise MotJaxError(f"{model_dir} has no model.safetensors(.index.json) or pytorch_model.bin weights.")
        return cls(list(files), base_prefix, files=files)

    @staticmethod
    def _safetensors_keys(path):
        from safetensors import safe_open

        try:
            with safe_open(path, "np") as f:
                return list(f.keys())
        except Exception as e:
            raise MotJaxError(
                f"Cannot read {path} ({e}); the file is corrupt or truncated, download it again."
            ) from None

    @staticmethod
    def _load_torch_bins(paths):
        try:
            import torch
        except ImportError:
            raise MotJaxError(
                "This checkpoint has only pytorch_model.bin; install torch or convert it to safetensors."
            ) from None
        tensors = {}
        for p in paths:
            try:
                state = torch.load(p, map_location="cpu", weights_only=True)
            except Exception as e:
                raise MotJaxError(
                    f"Cannot read {p} ({type(e).__name__}); the file is corrupt, download it again."
                ) from None
            tensors.update({k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()})
        return tensors

    def full_name(self, name):
        """The name as the checkpoint spells it (with its base-model prefix)."""
        return self.by_name.get(name) or (name if name.startswith("lm_head") else self.prefix + name)

    def names(self):
        return set(self.by_name)

    def get(self, name) -> np.ndarray:
        full = self.by_name[name]
        if full in self.arrays:
            return self.arrays[full]
        from safetensors import safe_open

        path = self.files[full]
        try:
            if path not in self._open:
                self._open[path] = safe_open(path, "np")
            return self._open[path].get_tensor(full)
        except Exception as e:
            raise MotJaxError(
                f"Cannot read tensor {full!r} from {path} ({e}); the file is corrupt, download it again."
            ) from None


def build_model(cfg: ModelConfig, dtype=jnp.float32, seed=0, abstract=False, mesh=None, rules=sharding.RULES):
    """A randomly initialised model of this config (or its abstract shapes with `abstract=True`). With a `mesh`, it is
    initialised in host memory (the CPU backend: the same values as without a mesh on a CPU machine) and each
    device then receives only its slice of each param, in its sharding by `rules`."""
    _, cls = FAMILY_BY_NAME[cfg.family]
    make = lambda: cls(cfg, rngs=nnx.Rngs(seed), dtype=dtype)
    if abstract:
        return nnx.eval_shape(make)
    if mesh is None:
        return make()
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        model = make()
    for var in flat_params(model).values():
        var.set_value(placed(np.asarray(var[...]), var.dtype, sharding.param_sharding(var, mesh, rules)))
    return model


def flat_params(model) -> dict:
    """{dotted path: Param} of a model."""
    return {".".join(map(str, path)): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def load_params_into(model, source: TensorSource, table, ignored=(), mesh=None, rules=sharding.RULES):
    """Fill an (abstract) model's params from `source` through `table`; checks names and shapes. With a `mesh`, each
    param is created in its sharding by `rules` (see `placed`), else on the default device."""
    cfg, dtype = model.config, model.param_dtype
    params = flat_params(model)
    filled = set()
    unused = source.names()
    for rule in table:
        names = [rule.hf.format(i=i) for i in range(cfg.num_layers)] if rule.per_layer else [rule.hf]
        target = params[rule.ours]
        expected = target.shape[1:] if rule.per_layer else target.shape
        slices = []
        for name in names:
            if name not in source.by_name:
                full = source.full_name(name)
                raise MotJaxError(f"The checkpoint lacks tensor {full!r} that a {cfg.family} model needs.")
            value = rule.to_ours(source.get(name))
            if value.shape != tuple(expected):
                raise MotJaxError(
                    f"Tensor {source.full_name(name)!r} has shape {value.shape} after conversion but the config "
                    f"implies {tuple(expected)}; the weights do not match config.json."
                )
            slices.append(value)
            unused.discard(name)
        value = np.stack(slices) if rule.per_layer else slices[0]
        del slices  # the per-layer copies: one host copy of the tensor at a time
        if mesh is None:
            target.set_value(jnp.asarray(value, dtype=dtype))
        else:
            target.set_value(placed(value, dtype, sharding.param_sharding(target, mesh, rules)))
        filled.add(rule.ours)
    unexpected = sorted(source.full_name(n) for n in unused if not any(re.search(p, n) for p in ignored))
    if unexpected:
        raise MotJaxError(
            f"The checkpoint has tensor {unexpected[0]!r} (and {len(unexpected) - 1} more) that a {cfg.family} "
            "model does not use."
        )
    assert filled == set(params), f"the {cfg.family} mapping table misses {set(params) - filled}"
    return model


def placed(host: np.ndarray, dtype, where: jax.sharding.Sharding) -> jax.Array:
    """A host tensor as an array in sharding `where`: each device receives only its own slice, converted to `dtype`
    on the host (as `jnp.asarray(host, dtype)` converts)."""
    return jax.make_array_from_callback(host.shape, where, lambda index: np.asarray(host[index], dtype))


def load_dir(model_dir: Path, dtype="float32", mesh=None, rules=sharding.RULES):
    """(model, config dict) of a Hugging Face checkpoint directory: config.json and its weights (on `mesh` by
    `rules` when given, see `load_params_into`)."""
    hf_config, cfg = read_config(model_dir)
    source = TensorSource.from_dir(model_dir, FAMILY_BY_NAME[cfg.family][0].BASE_PREFIX)
    return load_from_source(cfg, source, dtype, mesh, rules), hf_config


def load_from_source(cfg: ModelConfig, source: TensorSource, dtype="float32", mesh=None, rules=sharding.RULES):
    """A model of `cfg` with its parameters from `source` through the family's table (names and shapes checked)."""
    module, _ = FAMILY_BY_NAME[cfg.family]
    ignored = IGNORED + ((r"^lm_head\.weight$",) if cfg.tie_embeddings else ())
    model = build_model(cfg, resolve_dtype(dtype), abstract=True)
    return load_params_into(model, source, module.hf_table(cfg), ignored, mesh, rules)


def hf_state_dict(model) -> dict[str, np.ndarray]:
    """Our params as HF tensors (names with the base-model prefix), the reverse of `load_dir`."""
    cfg = model.config
    module, _ = FAMILY_BY_NAME[cfg.family]
    flat = {path: np.asarray(jax.device_get(var[...])) for path, var in flat_params(model).items()}
    tensors = to_hf_state_dict(flat, module.hf_table(cfg), cfg.num_layers)
    prefix = module.BASE_PREFIX
    return {(n if n.startswith("lm_head") else prefix + n): t for n, t in tensors.items()}
