#!/usr/bin/env bash
# The device check: what a fresh GPU machine measures in 8 minutes at most, with no network, written as one Markdown
# section to paste into BENCHMARKS.md (launch/device_check.py says what it runs).
#
#   bash launch/device_check.sh [--cpu] [--out=FILE]      # default FILE: device_check.md here
#
# Expects this repository with mot_jax's requirements and a CUDA build of jax installed (launch/gpu.sh installs them);
# the weights are random in the real models' shapes, so nothing is downloaded. --cpu: a dry run at tiny sizes on the
# CPU (CI runs it; 15 minutes at most). Each part's result is written as it ends, so a check stopped at 8 minutes (or
# by Ctrl-C) keeps what it did and says where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=480
[[ " $* " == *" --cpu "* ]] && limit=900  # the dry run compiles on a small CPU
exec timeout --kill-after=10 "$limit" python launch/device_check.py "$@"
