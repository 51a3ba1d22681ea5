# shellcheck shell=bash disable=SC2034
# Shared by the launch scripts (sourced, not run): --dry-run handling and command echoing.
# DRY_RUN=1 makes `run` print each command (quoted so that it can be pasted into a shell) instead of running it.

DRY_RUN=${DRY_RUN:-0}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The pinned JAX version: accelerator builds (jax[cuda12], jax[tpu]) must match the CPU jax in requirements.txt.
JAX_VERSION=$(sed -n 's/^jax==//p' "$REPO_ROOT/requirements.txt")
# The embedded GGUF models' tokenizers are built by transformers, which needs torch; the CPU build is enough.
TORCH_VERSION=$(sed -n 's/^torch==//p' "$REPO_ROOT/requirements-dev.txt")
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

quote() {  # the arguments as one shell-safe line (--flag='value' when only the value needs quotes)
  local out=() arg flag
  for arg in "$@"; do
    flag=""
    if [[ $arg =~ ^(--[A-Za-z0-9_.-]+=)(.*)$ ]]; then
      flag=${BASH_REMATCH[1]}
      arg=${BASH_REMATCH[2]}
    fi
    if [[ $arg =~ ^[A-Za-z0-9_./:=@%+,-]+$ || ( -n $flag && -z $arg ) ]]; then
      out+=("$flag$arg")
    else
      out+=("$flag'${arg//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

run() {
  if [[ $DRY_RUN == 1 ]]; then
    quote "$@"
  else
    echo "+ $(quote "$@")" >&2
    "$@"
  fi
}

die() {
  echo "error: $*" >&2
  exit 2
}
