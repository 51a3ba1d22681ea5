"""Compile for a Cloud TPU topology on this machine and report what a chip needs:
`python -m mot_jax.compile --config=configs/NAME.py[:ARG] --topology=v5e:4x4 [--program=train|prefill|decode]
[--tokens=N]`.

Needs libtpu (`bash launch/setup.sh --tpu-compile`), no TPU: the config's models (and for `train` its translator and
AdamW state) are built abstractly in their real shapes, sharded by the config's rules over the topology's chips, and
compiled ahead of time (`mot_jax.aot`). `train` compiles the training step the trainer runs, in the config's shapes.
Refuses in one line (exit 2) when a chip would not hold the program.
"""

from __future__ import annotations

import os

from absl import app, flags
from ml_collections import config_flags

from mot_jax.cli import config_flags_parser, no_arguments, run_or_exit

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/NAME.py[:ARG]).")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:4x4", "TPU topology GENERATION:SHAPE (v4, v5e, v5p, v6e).")
_PROGRAM = flags.DEFINE_enum(
    "program", "prefill", ["train", "prefill", "decode"], "The program to compile: the training step or the target's."
)
_TOKENS = flags.DEFINE_integer(
    "tokens",
    None,
    "Prefill: prompt tokens a row (default 1,024, or the target's positions if fewer); decode: the tokens already "
    "cached. Not for train.",
)
_BATCH = flags.DEFINE_integer("batch", None, "Prefill and decode: rows (default: one a chip). Not for train.")
flags.mark_flags_as_required(["config"])


def main(argv):
    no_arguments(argv)
    from mot_jax import aot  # after flag parsing: importing jax is slow

    print(run_or_exit(aot.run, _CONFIG.value, _TOPOLOGY.value, _PROGRAM.value, _TOKENS.value, _BATCH.value))


def run():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # it only compiles: the TPU is described, never opened
    app.run(main, flags_parser=config_flags_parser(_CONFIG, "mot_jax/training/config.py"))


if __name__ == "__main__":
    run()
