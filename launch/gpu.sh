#!/usr/bin/env bash
# Train on one machine with NVIDIA GPUs, using all of its local GPUs (one process; the mesh's `data` axis spans them).
#
# Expects: Linux x86_64 with an NVIDIA driver for CUDA 12 (CUDA=cuda13 for a CUDA 13 driver), Python 3.11 as
# `python` (a virtualenv is best), and this repository checked out. It installs mot_jax with launch/setup.sh, the
# CUDA build of the pinned JAX version (jax[cuda12]==<jax in requirements.txt>) and CPU torch (transformers builds
# the embedded models' tokenizers with it), checks that JAX sees GPUs, and runs the config. The global batch
# (--config.batch_size) must be a multiple of the GPU count.
#
#   bash launch/gpu.sh [--dry-run] [--no-setup] [CONFIG [WORKDIR]] [-- TRAIN_FLAGS...]
#   bash launch/gpu.sh configs/quickstart.py /tmp/mot_gpu -- --config.batch_size=8
#
# CONFIG defaults to configs/quickstart.py, WORKDIR to /tmp/mot_gpu; rerunning resumes from WORKDIR.
# Env: CUDA (cuda12 | cuda13, default cuda12). --dry-run prints the commands instead of running them.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"

setup=1
positional=()
extra=()
while (($#)); do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --no-setup) setup=0 ;;
    --) shift; extra=("$@"); break ;;
    -*) die "unknown option $1 (usage: bash launch/gpu.sh [--dry-run] [--no-setup] [CONFIG [WORKDIR]] [-- FLAGS])" ;;
    *) positional+=("$1") ;;
  esac
  shift
done
config=${positional[0]:-configs/quickstart.py}
workdir=${positional[1]:-/tmp/mot_gpu}
cuda=${CUDA:-cuda12}
[[ $cuda == cuda12 || $cuda == cuda13 ]] || die "CUDA=$cuda; use cuda12 or cuda13"

cd "$REPO_ROOT"
if ((setup)); then
  run bash launch/setup.sh
  run python -m pip install --quiet "jax[$cuda]==$JAX_VERSION"
  run python -m pip install --quiet "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
fi
run python -c 'import jax; print(jax.devices("gpu"))'  # fails when JAX sees no GPU
run python -m mot_jax.train "--config=$config" "--workdir=$workdir" "${extra[@]}"
