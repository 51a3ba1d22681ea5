"""The model layer's forward API (`mot_jax.models.hooks`) and its one attention entry (`mot_jax.models.attention`):
what hooks see and record, whichever way the layers run, and which implementation the entry picks."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from jax.sharding import Mesh

from mot_jax import aot, kernels, sharding
from mot_jax.models import accelerated, attention
from mot_jax.models.attention import Mask
from mot_jax.models.hooks import Forward, LayerHook, LayerInputs
from mot_jax.models.loading import load_model


@pytest.fixture(scope="module")
def model():
    return load_model("random:llama")[0]


@struct.dataclass
class ScaleValues(LayerHook):
    """Doubles the values every layer's attention reads and records the keys' sum."""

    def attention(self, read, layer, record):
        record.put("key_sum", read.k.sum())
        return read.replace(v=read.v * 2.0)


def test_records_stack_over_the_layers_that_ran_in_the_scan_and_over_per_layer_weights(model):
    ids = jax.random.randint(jax.random.key(0), (2, 7), 3, model.config.vocab_size)
    forward = Forward(ids, stop=3)
    scanned = model.run_layers(forward, hooks=[LayerInputs(), ScaleValues()])
    unrolled = model.run_layers(forward.replace(weights=model.layer_params()), hooks=[LayerInputs(), ScaleValues()])
    assert scanned.records["inputs"].shape == (3, 2, 7, model.config.hidden_size)
    assert scanned.records["key_sum"].shape == (3,)
    for name in ("inputs", "key_sum"):
        np.testing.assert_allclose(unrolled.records[name], scanned.records[name], rtol=1e-6, atol=1e-6)
    # layer 0's input is the token embeddings; the stream before layer 3 is the hidden state returned with stop=3
    np.testing.assert_array_equal(scanned.records["inputs"][0], model.embed(ids, jnp.tile(jnp.arange(7), (2, 1))))
    plain = model.run_layers(forward)
    assert plain.records == {}
    # the changed values change the layers above the first, not the first layer's own K/V (written before the read)
    np.testing.assert_array_equal(scanned.cache.k[0], plain.cache.k[0])
    assert not np.allclose(scanned.cache.k[1], plain.cache.k[1])
    np.testing.assert_array_equal(scanned.cache.k[3:], plain.cache.k[3:])  # layers above stop never ran: still zeros


@struct.dataclass
class KeyValuesFromLayer(LayerHook):
    """Layers from `first` on write their new tokens' K/V of the input stream of layer `first` (carried up)."""

    first: int = struct.field(pytree_node=False)

    def carry(self, x):
        return {"held": jnp.zeros_like(x)}

    def layer_input(self, x, layer, record):
        record.carried["held"] = jnp.where(layer == self.first, x, record.carried["held"])
        return x

    def key_values(self, new, layer, record):
        k, v = new.project(record.carried["held"])
        use = layer >= self.first
        return new.replace(k=jnp.where(use, k, new.k), v=jnp.where(use, v, new.v))


def test_a_hook_replaces_the_key_values_a_layer_writes_from_a_state_it_carried_up(model):
    ids = jax.random.randint(jax.random.key(1), (2, 6), 3, model.config.vocab_size)
    positions = jnp.tile(jnp.arange(6), (2, 1))
    plain = model.run_layers(Forward(ids), hooks=[LayerInputs()])
    hooked = model.run_layers(Forward(ids), hooks=[KeyValuesFromLayer(1)])
    # the cache holds what layers 2 and 3's own projections make of layer 1's input; the layers below keep their own
    held = jnp.stack([plain.records["inputs"][1]] * 2, 2)  # [B, T, 2 layers, D]
    k, v = model.layer_key_values((2, 3), held, held, positions)
    np.testing.assert_allclose(hooked.cache.k[2:], k.transpose(2, 0, 3, 1, 4), atol=1e-6, rtol=0)
    np.testing.assert_allclose(hooked.cache.v[2:], v.transpose(2, 0, 3, 1, 4), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(hooked.cache.k[:2], plain.cache.k[:2])
    assert not np.allclose(hooked.hidden, plain.hidden, atol=1e-3)  # the attention read what was written
    # the layers one after another carry the state as the scan does, and a forward after a cache (the decode path)
    # as a fresh prefill does
    unrolled = model.run_layers(Forward(ids, weights=model.layer_params()), hooks=[KeyValuesFromLayer(1)])
    np.testing.assert_allclose(unrolled.hidden, hooked.hidden, atol=1e-5, rtol=0)
    first = model.run_layers(Forward(ids[:, :4]), model.init_cache(2, 6), [KeyValuesFromLayer(1)])
    rest = model.run_layers(Forward(ids[:, 4:]), first.cache, [KeyValuesFromLayer(1)])
    np.testing.assert_allclose(rest.hidden, hooked.hidden[:, 4:], atol=1e-5, rtol=0)
    # with no layer at or above `first` the hook changes nothing: bit for bit the plain run
    untouched = model.run_layers(Forward(ids), hooks=[LayerInputs(), KeyValuesFromLayer(model.config.num_layers)])
    np.testing.assert_array_equal(untouched.hidden, plain.hidden)
    np.testing.assert_array_equal(untouched.cache.k, plain.cache.k)


def operands(dtype=jnp.float32):
    q = jnp.ones((1, 4, 2, 8), dtype)
    k = v = jnp.ones((1, 1, 4, 8), dtype)
    pos = jnp.arange(4)[None]
    return q, k, v, Mask(pos, pos, jnp.ones((1, 4), bool))


def test_the_entry_picks_the_cpu_kernel_only_on_the_cpu_and_where_nothing_needs_the_weights(monkeypatch):
    q, k, v, mask = operands()
    monkeypatch.setattr(kernels, "supports", lambda *a: True)
    assert attention.implementation(q, k, v, mask) == "cpu_kernel"
    assert attention.implementation(q, k, v, mask, needs_weights=True) == "xla"
    chosen = mask.replace(allowed=jnp.ones((1, 4, 4), bool))
    assert attention.implementation(q, k, v, chosen) == "xla"
    monkeypatch.setattr(kernels, "supports", lambda *a: False)
    assert attention.implementation(q, k, v, mask) == "xla"


def test_the_entry_picks_splash_on_a_tpu_for_a_causal_prefill_and_cudnn_on_a_gpu_where_it_applies(monkeypatch):
    q, k, v, mask = operands()
    monkeypatch.setattr(kernels, "supports", lambda *a: True)  # never on another backend
    monkeypatch.setattr(attention, "default_backend", lambda: "tpu")
    assert attention.implementation(q, k, v, mask.replace(causal_prefill=True)) == "tpu"
    assert attention.implementation(q, k, v, mask) == "xla"  # a continuation's slots are not known when tracing
    monkeypatch.setattr(attention, "default_backend", lambda: "gpu")  # cuDNN where its own predicate says so
    monkeypatch.setattr(accelerated, "gpu_supports", lambda q, k, v, softcap: softcap is None)
    assert attention.implementation(q, k, v, mask) == "gpu"
    assert attention.implementation(q, k, v, mask, softcap=30.0) == "xla"
    assert attention.implementation(q, k, v, mask, needs_weights=True) == "xla"


def test_under_a_mesh_the_entry_splits_splash_over_the_rows_where_they_divide():
    """`mesh_split`: the rows over the axis the `batch` rule names, KV heads over the `kv_heads` rule's (`tensor`),
    each only where it divides; nothing without a mesh of several devices or off its axes."""
    mesh = Mesh(np.reshape(jax.devices()[:8], (4, 2)), ("data", "expert"))
    q, k = jnp.zeros((8, 4, 4, 16)), jnp.zeros((8, 2, 4, 16))
    assert attention.mesh_split(q, k) == {}  # no mesh set
    with jax.set_mesh(mesh):
        assert attention.default_backend() == "cpu"  # the mesh's platform: these devices' own
        split = attention.mesh_split(q, k)
        assert (split["batch_axes"], split["head_axes"], dict(split["mesh"].shape)) == ("data", None, mesh.shape)
        assert attention.mesh_split(q[:2], k[:2])["batch_axes"] is None  # 2 rows do not split 4 ways
    with jax.set_mesh(sharding.make_mesh(data=4, expert=1, tensor=2)):
        assert attention.mesh_split(q, k)["head_axes"] == "tensor"
        assert attention.mesh_split(q, k[:, :1])["head_axes"] is None
    with jax.set_mesh(Mesh(np.reshape(jax.devices()[:1], (1, 1)), ("data", "expert"))):
        assert attention.mesh_split(q, k) == {}


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_a_tpu_slices_mesh_makes_the_entry_choose_splash_on_this_cpu():
    """An ahead-of-time compile for a TPU slice traces on this CPU under the slice's mesh: the entry takes the TPU
    route by the mesh's platform (no TPU is opened)."""
    q, k, v, mask = operands(jnp.bfloat16)
    _, devices = aot.topology("v5e:2x2")
    with jax.set_mesh(Mesh(np.reshape(devices, (4, 1)), ("data", "expert"))):
        assert attention.default_backend() == "tpu"
        assert attention.implementation(q, k, v, mask.replace(causal_prefill=True)) == "tpu"
        assert attention.implementation(q, k, v, mask) == "xla"  # a continuation: XLA's path on the TPU


def test_a_prefill_routed_to_splash_equals_xlas_path(monkeypatch):
    """A Gemma-3-shaped prefill (sliding and global layers in one scan, left padding) through the TPU route, splash
    run in interpret mode on the CPU, against the same prefill on XLA's path."""
    model = load_model("random:gemma3")[0]
    ids = jax.random.randint(jax.random.key(1), (2, 40), 3, model.config.vocab_size)
    mask = jnp.ones((2, 40), bool).at[1, :7].set(False)
    monkeypatch.setattr(kernels, "supports", lambda *a: False)
    want = model.run_layers(Forward(ids, mask))
    monkeypatch.setattr(attention, "default_backend", lambda: "tpu")
    splash = functools.partial(accelerated.tpu_attention, interpret=True)
    chosen = []
    monkeypatch.setattr(accelerated, "tpu_attention", lambda *a, **kw: chosen.append(1) or splash(*a, **kw))
    got = model.run_layers(Forward(ids, mask))
    assert chosen  # traced once: the layer scan's body
    valid = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(got.hidden)[valid], np.asarray(want.hidden)[valid], atol=2e-5, rtol=2e-5)
    slots = lambda kv: np.asarray(kv).transpose(1, 3, 0, 2, 4)[valid]  # [valid tokens, L, K, d]
    # a padding query's output differs (splash masks by slot; no valid token reads it), so padding slots' K/V too
    np.testing.assert_allclose(slots(got.cache.k), slots(want.cache.k), atol=2e-5, rtol=2e-5)


def test_the_entry_hands_each_query_blocks_weights_to_the_caller(monkeypatch):
    """Blocks of a causal prefill each read the keys up to their last query; their weights are the full softmax's
    rows (closed form: all-equal logits give each query 1 / (its visible keys))."""
    monkeypatch.setattr(attention, "PREFILL_BLOCK", 2)
    q, k, v, mask = operands()
    seen = []
    out = attention.attend(
        q, k, v, mask.replace(causal_prefill=True), scale=1.0, on_weights=lambda p, s, b: seen.append((s, p))
    )
    assert [s for s, _ in seen] == [0, 2] and [p.shape[-1] for _, p in seen] == [2, 4]
    weights = np.concatenate([np.pad(p, [(0, 0)] * 4 + [(0, 4 - p.shape[-1])]) for _, p in seen], axis=3)[0, 0, 0]
    np.testing.assert_allclose(weights, np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None], rtol=1e-6)
    np.testing.assert_allclose(out, np.ones((1, 4, 16)), rtol=1e-6)


def test_remat_recomputes_the_layers_in_the_backward_pass_with_the_same_gradients(model, monkeypatch):
    """The gradient of a loss through the layer scan (as a translator's gradient flows through the target's replay)
    equals the one without rematerialisation, and the differentiated program does recompute (a remat'd scan body)."""
    ids = jax.random.randint(jax.random.key(4), (2, 9), 3, model.config.vocab_size)
    x = model.embed(ids, jnp.tile(jnp.arange(9), (2, 1)))

    def loss(scale):
        return jnp.sum(model.run_layers(Forward(ids, embeddings=x * scale)).hidden ** 2)

    want = jax.grad(loss)(1.5)
    assert "remat" not in str(jax.make_jaxpr(jax.grad(loss))(1.5))
    for policy in ("dots", "nothing"):
        monkeypatch.setattr(model, "remat", policy)
        assert "remat" in str(jax.make_jaxpr(jax.grad(loss))(1.5))
        np.testing.assert_allclose(jax.grad(loss)(1.5), want, rtol=1e-5)
