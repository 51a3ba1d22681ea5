"""Export of trained translators for use outside JAX (a torch-only implementation and its weight files)."""
