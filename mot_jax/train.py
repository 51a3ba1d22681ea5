"""Train a translator: `python -m mot_jax.train --config=configs/NAME.py[:tiny] --workdir=DIR [--config.key=value]`.

Restarting the same command on the same workdir resumes from its latest checkpoint.

Multi-process (several hosts, or one process per GPU): start the same command in every process; it joins the others
through `jax.distributed` when given --coordinator_address, --num_processes and --process_id (or the environment
variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), or when started by SLURM (srun, several
tasks), Open MPI or on a Cloud TPU VM (--distributed forces it, --nodistributed prevents it).
"""

from __future__ import annotations

import os

from absl import app, flags, logging
from ml_collections import config_flags

from mot_jax.cli import config_flags_parser, log_info_quietly, no_arguments, run_or_exit

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/NAME.py[:ARG]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and TensorBoard events.")
flags.mark_flags_as_required(["config", "workdir"])
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", os.environ.get("JAX_COORDINATOR_ADDRESS"), "Multi-process: HOST:PORT of process 0."
)
# read in main (a malformed variable: one line there, not a traceback at import)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-process: N (default $JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-process: 0 .. N-1 (default $JAX_PROCESS_ID).")
_COMPILATION_CACHE = flags.DEFINE_bool(
    "compilation_cache",
    True,
    "Keep compiled programs in the cache folder ($MOT_JAX_CACHE/xla) so that the next run loads them instead of "
    "compiling again; --nocompilation_cache: compile every time.",
)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed",
    None,
    "Join a multi-process run through jax.distributed (JAX detects the cluster); default: when "
    "the flags above, SLURM, Open MPI or a Cloud TPU VM say so; --nodistributed: never.",
)


def main(argv):
    no_arguments(argv)
    log_info_quietly()
    from mot_jax import multihost  # after flag parsing: importing jax is slow
    from mot_jax.paths import use_compilation_cache
    from mot_jax.training.loop import train_and_evaluate

    use_compilation_cache(_COMPILATION_CACHE.value)

    def initialize():  # before any other JAX call; a single process stays as it is
        num_processes = _NUM_PROCESSES.value
        process_id = _PROCESS_ID.value
        num_processes = multihost.env_int("JAX_NUM_PROCESSES") if num_processes is None else num_processes
        process_id = multihost.env_int("JAX_PROCESS_ID") if process_id is None else process_id
        return multihost.initialize(_COORDINATOR.value, num_processes, process_id, _DISTRIBUTED.value)

    run_or_exit(initialize)
    if not multihost.is_main():
        logging.set_verbosity(logging.WARNING)  # process 0 logs for the run
    run_or_exit(train_and_evaluate, _CONFIG.value, _WORKDIR.value)


def run():
    app.run(main, flags_parser=config_flags_parser(_CONFIG, "mot_jax/training/config.py"))


if __name__ == "__main__":
    run()
