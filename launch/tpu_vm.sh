#!/usr/bin/env bash
# Train on a Cloud TPU VM slice: create it, copy this checkout (or clone REPO) to every host and set it up, train on
# every host at once (--worker=all: one process per host; they join through jax.distributed), then delete it.
#
# Expects: the gcloud CLI, logged in (gcloud auth login), the Cloud TPU API enabled in PROJECT and quota for
# ACCELERATOR in ZONE. Single-host slices (v4-8, v5litepod-8) may keep WORKDIR on the VM's disk; multi-host slices
# (v4-16 and up, v5litepod-16 and up) need WORKDIR=gs://BUCKET/DIR, one directory that every host reads and writes
# (the TPU VM's service account needs write access to the bucket).
#
#   PROJECT=my-project bash launch/tpu_vm.sh [--dry-run] create|setup|train|delete|all [-- TRAIN_FLAGS...]
#
# Env, with defaults:
#   PROJECT      Google Cloud project (required)
#   ZONE         us-central2-b (v4); for v5e e.g. us-west4-a or europe-west4-b
#   ACCELERATOR  v4-8; e.g. v4-16 (2 hosts), v5litepod-8 (1 host), v5litepod-16 (2 hosts), v5p-8, v6e-8
#   RUNTIME      by generation: tpu-ubuntu2204-base (v4), v2-alpha-tpuv5-lite (v5litepod), v2-alpha-tpuv5 (v5p),
#                v2-alpha-tpuv6e (v6e)
#   TPU_NAME     mot-jax
#   SPOT         0; 1 creates a Spot TPU (cheaper, can be preempted: the run saves its last step on SIGTERM; rerun
#                `train` to resume)
#   QUEUED       0; 1 asks for the slice through a queued resource (named TPU_NAME too): `create` waits until it is
#                granted (up to QUEUE_HOURS, default 24, polled every 60 s), `delete` deletes the request and its slice.
#                Large slices and v5p/v6e capacity are usually granted this way only.
#   REPO         unset: copy this checkout (tracked and untracked, not ignored files); or a git URL to clone (REF)
#   CONFIG       configs/quickstart.py
#   WORKDIR      mot_runs/quickstart (under each host's ~/mot_jax); gs://BUCKET/DIR for multi-host slices
# `all` runs create, setup, train and delete (delete also when a step fails). Each host gets Python 3.11 in
# ~/mot_venv (through uv), mot_jax (launch/setup.sh), jax[tpu] of the pinned JAX version, CPU torch and gcsfs.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"

usage="usage: PROJECT=... bash launch/tpu_vm.sh [--dry-run] create|setup|train|delete|all [-- TRAIN_FLAGS...]"
command=""
extra=()
while (($#)); do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    create | setup | train | delete | all) command=$1 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown argument $1 ($usage)" ;;
  esac
  shift
done
[[ -n $command ]] || die "$usage"
[[ -n ${PROJECT:-} ]] || die "set PROJECT to your Google Cloud project ($usage)"
accelerator=${ACCELERATOR:-v4-8}
case "$accelerator" in
  v5litepod-*) default_runtime=v2-alpha-tpuv5-lite ;;
  v5p-*) default_runtime=v2-alpha-tpuv5 ;;
  v6e-*) default_runtime=v2-alpha-tpuv6e ;;
  *) default_runtime=tpu-ubuntu2204-base ;;
esac
runtime=${RUNTIME:-$default_runtime}
queued=${QUEUED:-0}
[[ $queued == 0 || $queued == 1 ]] || die "QUEUED=$queued: set it to 1 (a queued resource) or 0 (a TPU VM at once)"
name=${TPU_NAME:-mot-jax}
config=${CONFIG:-configs/quickstart.py}
workdir=${WORKDIR:-mot_runs/quickstart}
where=("--project=$PROJECT" "--zone=${ZONE:-us-central2-b}")
gcloud_tpu=(gcloud compute tpus tpu-vm)
gcloud_queued=(gcloud compute tpus queued-resources)

on_all_hosts() {  # one shell command line, run on every host of the slice at once
  run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command="$1"
}

create() {
  local spot=()
  [[ ${SPOT:-0} == 1 ]] && spot=(--spot)
  if [[ $queued == 0 ]]; then
    run "${gcloud_tpu[@]}" create "$name" "${where[@]}" "--accelerator-type=$accelerator" "--version=$runtime" \
      "${spot[@]}"
    return
  fi
  run "${gcloud_queued[@]}" create "$name" "${where[@]}" "--node-id=$name" "--accelerator-type=$accelerator" \
    "--runtime-version=$runtime" "${spot[@]}"
  wait_until_granted
}

wait_until_granted() {  # a queued resource waits for capacity: poll its state until ACTIVE
  local state describe=("${gcloud_queued[@]}" describe "$name" "${where[@]}" "--format=value(state.state)")
  if [[ $DRY_RUN == 1 ]]; then
    run "${describe[@]}"
    return
  fi
  local deadline=$((SECONDS + ${QUEUE_HOURS:-24} * 3600))
  while state=$("${describe[@]}"); [[ $state != ACTIVE ]]; do
    case "$state" in
      FAILED | SUSPENDED) die "the queued resource $name is $state; see: ${describe[*]:0:5} $name" ;;
    esac
    ((SECONDS < deadline)) || die "the queued resource $name was not granted in ${QUEUE_HOURS:-24} h (state $state)"
    echo "queued resource $name: $state; waiting for capacity" >&2
    sleep 60
  done
}

setup() {
  local fetch
  if [[ -n ${REPO:-} ]]; then
    fetch="rm -rf ~/mot_jax && git clone --depth 1 $(quote ${REF:+--branch "$REF"} "$REPO") ~/mot_jax"
  else
    local tarball=/tmp/mot_jax_src.tar.gz
    local files="git ls-files -z --cached --others --exclude-standard"  # what git tracks or would
    run bash -c "cd $(quote "$REPO_ROOT") && $files | tar czf $tarball --null -T -"
    run "${gcloud_tpu[@]}" scp "$tarball" "$name:mot_jax_src.tar.gz" "${where[@]}" --worker=all
    fetch="rm -rf ~/mot_jax && mkdir ~/mot_jax && tar xzf ~/mot_jax_src.tar.gz -C ~/mot_jax"
  fi
  on_all_hosts "set -e; $fetch
python3 -m pip install --user --quiet uv && ~/.local/bin/uv venv --seed --python 3.11 ~/mot_venv
. ~/mot_venv/bin/activate && cd ~/mot_jax && bash launch/setup.sh
pip install --quiet $(quote "jax[tpu]==$JAX_VERSION") gcsfs==2026.10.1
pip install --quiet torch==$TORCH_VERSION --index-url $TORCH_CPU_INDEX"
}

train() {
  # --distributed: every host joins the others (JAX reads the slice's hosts from the TPU metadata)
  on_all_hosts ". ~/mot_venv/bin/activate && cd ~/mot_jax && $(quote python -m mot_jax.train "--config=$config" \
    "--workdir=$workdir" --distributed "${extra[@]}")"
}

delete() {
  if [[ $queued == 1 ]]; then  # --force: the slice it granted too
    run "${gcloud_queued[@]}" delete "$name" "${where[@]}" --force --quiet
  else
    run "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet
  fi
}

case "$command" in
  all)
    trap delete EXIT  # the slice bills while it exists
    create
    setup
    train
    ;;
  *) "$command" ;;
esac
