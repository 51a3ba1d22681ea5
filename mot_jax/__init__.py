"""mot_jax: Mixture-of-Translators for KV caches in JAX / Flax NNX."""

__version__ = "0.1.0"
