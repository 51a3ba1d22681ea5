"""Helpers shared by the test modules: configs and commands, hand-built training batches and trainers, noisy
translators, tiny transformers models next to mot_jax's, and tiny GGUF files.

Test modules import from here (`from helpers import ...`), never from each other. tests/ has no __init__.py, so
pytest's default `prepend` import mode puts tests/ on sys.path as it imports conftest.py and the test modules; the same
makes hf_reference.py and numpy_reference.py importable, the independent re-implementations the tests compare against
(not helpers). torch, transformers and gguf are imported inside the helpers that use them, so that a module using only
the JAX helpers does not load them.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mot_jax.evals.config import defaults
from mot_jax.models import gguf as mgguf
from mot_jax.models import tiny
from mot_jax.models.base import ModelConfig
from mot_jax.models.generation import decode_step
from mot_jax.models.model_pair import load_pair
from mot_jax.models.registry import hf_state_dict
from mot_jax.training import config as config_lib
from mot_jax.training import loop, optim
from mot_jax.training.channel_search import resolve_channels
from mot_jax.training.data import make_batch
from mot_jax.training.setup import translation
from mot_jax.training.trained import load_trained
from mot_jax.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]  # the repository

# --- Configs and commands ---------------------------------------------------------------------------------------------

TINY_FLAGS = ["--config=configs/quickstart.py:replay,tiny"]  # the tiny training run, as `run_cli` passes it


def load_config(name="quickstart.py", arg="replay,tiny", **overrides):
    """configs/`name`'s `get_config(arg)`, with dotted keys overridden: `load_config(steps=2)`,
    `load_config(**{"optim.learning_rate": 1e-3})`."""
    spec = importlib.util.spec_from_file_location(name[:-3], ROOT / "configs" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg)
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def tiny_config(**translator):
    """The training config between random:llama and random:gemma3 at :tiny, terminal channels, with the given
    translator fields."""
    c = config_lib.tiny(config_lib.base(), "llama", "gemma3")
    c.translator.channels.mode = "terminal"
    c.translator.update(translator)
    return c


def small_config(**overrides):
    """The evaluation defaults cut to a few examples, short answers and small budgets (a tiny evaluation)."""
    config = defaults()
    config.update(
        dict(
            examples=2,
            batch_size=2,
            max_new_tokens=4,
            relay_tokens=4,
            budgets="48,96",
            agents=2,
            ttft_lengths="32,64",
            ttft_runs=1,
        )
        | overrides
    )
    return config


def one_device_command_env() -> dict:
    """The environment of a test command whose programs all run on one device (a tiny training run, an evaluation):
    its whole process compiles with the elemental emitter, as conftest.py has this process compile its one-device
    programs."""
    flags = os.environ["XLA_FLAGS"]
    if "xla_cpu_use_fusion_emitters" not in flags:
        flags += " --xla_cpu_use_fusion_emitters=false"
    return {**os.environ, "XLA_FLAGS": flags}


def run_cli(workdir, *flags, kill_at_step=None):
    """The training command (TINY_FLAGS and `flags`) in a fresh process; with `kill_at_step`, it SIGKILLs itself as
    that step starts."""
    script = "from mot_jax import train; train.run()"
    if kill_at_step:
        script = (
            "import os, signal; from mot_jax.training import loop; step = loop.Trainer.train_step\n"
            "def killing(self, batches, calls=[0]):\n"
            "    calls[0] += 1\n"
            f"    if calls[0] == {kill_at_step}: os.kill(os.getpid(), signal.SIGKILL)\n"
            "    return step(self, batches)\n"
            "loop.Trainer.train_step = killing\n" + script
        )
    command = [sys.executable, "-c", script, *TINY_FLAGS, f"--workdir={workdir}", *flags]
    return subprocess.run(command, cwd=ROOT, env=one_device_command_env(), capture_output=True, text=True, timeout=600)


# the closed-form FLOP counts' hand-checked model (tests/test_bench.py, tests/test_bench_eval.py): per token and layer
# q 8x8, k and v 8x4, o 8x8, gate/up/down 8x16
TINY_MODEL_CONFIG = ModelConfig(
    family="llama",
    vocab_size=32,
    hidden_size=8,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    max_positions=64,
    norm_eps=1e-6,
    activation="silu",
)


# --- Training: hand-built batches, trainers, interrupted runs ---------------------------------------------------------


def tiny_batch(source_tok, target_tok, batch=2, context=10, prompt=6, source_length=40, offset=0):
    """Consecutive rows of context + prompt + 1 target tokens of Python's documentation, as a training Batch
    (independent of the corpus and the chunk table)."""
    from pydoc_data.topics import topics

    ids = np.asarray(target_tok.encode(topics["assert"] + topics["while"] + topics["if"]).ids, np.int32)
    stride = context + prompt + 1
    rows = np.stack([ids[(offset + i) * stride : (offset + i + 1) * stride] for i in range(batch)])
    return make_batch(rows, context + 1, source_tok, target_tok, source_length)


class Fixed:
    """A stream of hand-built batches, cycled."""

    def __init__(self, batches):
        self.batches = batches

    def batch(self, position):
        return self.batches[position % len(self.batches)]


def trainer_for(c, mesh, steps):
    """A Trainer of config `c` on `mesh` for `steps` steps and its model pair (loaded, channels resolved without a
    search): (trainer, pair)."""
    pair = load_pair(c, mesh)
    channel_map = resolve_channels(c, pair, None, mesh, None)
    spec, tcfg = translation(c, channel_map, pair)
    return Trainer(c, pair, spec, tcfg, mesh, steps), pair


def sharing_jitted_steps(monkeypatch):
    """A Trainer built with the same arguments as an earlier one (config, translator spec and shape, mesh, step count,
    models' shapes) takes the earlier one's jitted functions, as JAX would share them were a new Trainer's bound methods
    the same function: each run of a test would otherwise trace and lower the same programs again (the persistent
    compilation cache spares only XLA's compile), most of a tiny run's time on a small CPU. A Trainer built with any
    argument different (a resume that got its step count wrong) jits its own. Each run still builds its own state,
    restores its own checkpoint and runs its own steps."""
    built, init = [], loop.Trainer.__init__
    names = ("_train", "_eval", "_baselines", "_skip_sums")

    def sharing(self, config, pair, spec, tcfg, mesh, total_steps, **options):
        init(self, config, pair, spec, tcfg, mesh, total_steps, **options)
        # the shapes the translator and the models are built from (their graphs hold each build's own activation)
        key = (config.to_json_best_effort(), spec, tcfg, mesh, total_steps, pair.source.config, pair.target.config)
        key += tuple(sorted(options.items()))
        earlier = next((functions for k, functions in built if k == key), None)
        if earlier is None:
            built.append((key, {name: getattr(self, name) for name in names}))
        else:
            self.__dict__.update(earlier)

    monkeypatch.setattr(loop.Trainer, "__init__", sharing)


def whole_and_resumed(config, root, monkeypatch, stop_after: int):
    """`config` trained in root/whole at once and in root/resumed stopped by Ctrl-C after step `stop_after` and run
    again: (the whole run's summary, [the whole run's trained translator, the resumed run's]). The update after the
    interruption must have a nonzero rate (the schedule's last has none), or a resume that lost the optimizer's
    moments would end where the whole run ends."""
    rate = optim.warmup_cosine(config.optim.learning_rate, config.optim.warmup_steps, config.steps)(stop_after)
    assert float(rate) > 0, f"step {stop_after + 1} of {config.steps} has rate 0: train at least {stop_after + 2} steps"
    sharing_jitted_steps(monkeypatch)
    whole = loop.train_and_evaluate(config, root / "whole")
    step, calls = loop.Trainer.train_step, []

    def interrupted(self, batches):  # Ctrl-C as step stop_after + 1 starts
        calls.append(1)
        if len(calls) == stop_after + 1:
            raise KeyboardInterrupt
        return step(self, batches)

    with monkeypatch.context() as patch:
        patch.setattr(loop.Trainer, "train_step", interrupted)
        with pytest.raises(loop.Interrupted, match=f"interrupted after step {stop_after}"):
            loop.train_and_evaluate(config, root / "resumed")
    loop.train_and_evaluate(config, root / "resumed")
    return whole, [load_trained(root / name).translator for name in ("whole", "resumed")]


# --- Translators ------------------------------------------------------------------------------------------------------


def perturb(translator, seed, scale=0.05):
    """Noise on every parameter (LayerNorm scales and biases included) so that init values hide no bug."""
    state = nnx.state(translator, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype) for leaf, k in zip(leaves, keys)]
    nnx.update(translator, jax.tree.unflatten(treedef, noisy))


# --- transformers next to mot_jax: models, greedy generation, caches --------------------------------------------------

TEXT = "The lighthouse keeper on Farrow Island counts ships at dawn and writes their names in a blue book."
NEW_TOKENS = 20  # tokens generated greedily by jax_greedy and assert_hf_cache_and_generation


def hf_model(name, tmp_path):
    """The tiny random mot_jax model as a transformers model (eager attention, its folder in `name_or_path`), and the
    mot_jax model and tokenizer (also in the folder, as tokenizer.json)."""
    import torch
    import transformers
    from safetensors.numpy import save_file

    model, config, tokenizer = tiny.load(name)
    folder = tmp_path / name.replace(":", "_")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer.save(str(folder / "tokenizer.json"))
    save_file({k: np.ascontiguousarray(v) for k, v in hf_state_dict(model).items()}, str(folder / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), attn_implementation="eager", dtype=torch.float32
    )
    return model, hf.eval(), tokenizer


def jax_greedy(target, cache, suffix):
    """mot_jax's NEW_TOKENS greedy tokens of `target` after `cache` and the `suffix` token ids."""
    logits, cache = target(jnp.asarray(suffix), cache=cache)
    tokens = [int(jnp.argmax(logits[0, -1]))]
    for _ in range(NEW_TOKENS - 1):
        logits, cache = decode_step(target, jnp.asarray([tokens[-1]], jnp.int32), cache)
        tokens.append(int(jnp.argmax(logits[0])))
    return tokens


def assert_hf_cache_and_generation(target_hf, cache, jax_cache, ids, suffix, expected):
    """The transformers cache equals mot_jax's (every layer's kept slots) and transformers' greedy tokens after it
    equal mot_jax's `expected` (up to an EOS)."""
    import torch

    length = ids.shape[1]
    for layer, hf_layer in enumerate(cache.layers):  # Gemma-3's sliding layers keep only their window's last slots
        kept = slice(length - hf_layer.keys.shape[2], length)
        np.testing.assert_allclose(hf_layer.keys.numpy(), np.asarray(jax_cache.k[layer, :, :, kept]), atol=1e-4)
        np.testing.assert_allclose(hf_layer.values.numpy(), np.asarray(jax_cache.v[layer, :, :, kept]), atol=1e-4)
    full = torch.as_tensor(np.concatenate([ids, suffix], 1), dtype=torch.long)
    out = target_hf.generate(
        input_ids=full,
        attention_mask=torch.ones_like(full),
        cache=cache,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    got = out[0, full.shape[1] :].tolist()
    assert got == expected[: len(got)] and (len(got) == NEW_TOKENS or got[-1] == 2), (got, expected)  # 2: EOS


# --- GGUF files -------------------------------------------------------------------------------------------------------


def gguf_tiny_config(arch):
    """A tiny random transformers config of the GGUF architecture `arch` (llama, qwen2, qwen3, gemma3), shaped as
    llama.cpp writes that family (vocabulary 97)."""
    import transformers

    configs = {
        "llama": lambda: transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            rope_theta=1e5,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            vocab_size=97,
        ),
        # q/k/v biases, GQA, untied head, its own RoPE base and norm eps: as llama.cpp writes Qwen2.5-Coder
        "qwen2": lambda: transformers.Qwen2Config(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            vocab_size=97,
            bos_token_id=1,
            eos_token_id=2,
        ),
        # heads x head_dim (4 x 16) wider than hidden_size (32), GQA, tied head (as llama.cpp writes Qwen3-0.6B)
        "qwen3": lambda: transformers.Qwen3Config(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            tie_word_embeddings=True,
            vocab_size=97,
            bos_token_id=1,  # Qwen3Config has none; the GGUF writer needs ints
            eos_token_id=2,
        ),
        # 7 layers: sliding pattern 6 (layer 5 global), window 4 shorter than the 12-token batch
        "gemma3": lambda: transformers.Gemma3TextConfig(
            num_hidden_layers=7,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            sliding_window=4,
            query_pre_attn_scalar=16,
            vocab_size=97,
            rope_parameters=dict(
                full_attention=dict(rope_type="default", rope_theta=1e6),
                sliding_attention=dict(rope_type="default", rope_theta=1e4),
            ),
        ),
    }
    return configs[arch]()


def write_gguf(path, model, arch):
    """A float32 GGUF of a transformers model, written the way llama.cpp's converter does (no tokenizer)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if arch == "llama":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_rope_dimension_count(cfg.head_dim)
    elif arch == "qwen2":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    elif arch == "qwen3":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    else:
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
    to_gguf = {
        f"model.layers.{{i}}.{v}": f"blk.{{i}}.{k}" for k, v in {**mgguf.LAYER, **mgguf.ARCH_LAYER[arch]}.items()
    }
    to_gguf.update({v: k for k, v in mgguf.TOP.items()})
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, kind = name.rsplit(".", 1)
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
        gname = (to_gguf[f"model.layers.{{i}}.{m[2]}"].format(i=m[1]) if m else to_gguf[stem]) + "." + kind
        x = t.float().numpy()
        if arch == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
            x = mgguf.permute_rope(x, cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            x = x + 1.0
        w.add_tensor(gname, np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
