"""Translating a source LLM's KV cache into a target LLM's: token alignment, channel (layer) maps and translators."""
