"""Multi-process runs (several hosts, or several processes on one host) on JAX's own multi-controller runtime.

Every process runs the same program. `initialize` joins the processes through `jax.distributed` before any JAX
computation; the mesh then spans every process's devices, each process builds only its rows of each global batch
(`local_rows`), and `prepare_lock` keeps processes that share a disk from building the same corpus, chunk table or
model cache at once. A single process skips all of it.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import random
from pathlib import Path

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from mot_jax.errors import MotJaxError, cause
from mot_jax.locks import file_lock

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def env_int(name: str, environ=os.environ, default=None) -> int | None:
    """The whole number in environment variable `name` (`default` when unset); anything else refused in one line."""
    text = environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise MotJaxError(f"{name}={text!r} is not a whole number; set it to one, or unset it.") from None


def detected_cluster(environ=os.environ) -> str | None:
    """The launcher that started this process as one of several, among those `jax.distributed` detects by itself;
    None when nothing says so (a plain single process)."""
    if all(v in environ for v in SLURM_VARS) and env_int("SLURM_NTASKS", environ) > 1:
        return "slurm"
    if env_int("OMPI_COMM_WORLD_SIZE", environ, 1) > 1:
        return "openmpi"
    if "," in environ.get("TPU_WORKER_HOSTNAMES", "") + environ.get("TPU_PROCESS_ADDRESSES", ""):
        return "tpu-gke"
    # a Cloud TPU VM: JAX reads the slice's workers from the metadata server (one worker: a 1-process "cluster")
    tpu_chips = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    if tpu_chips and importlib.util.find_spec("libtpu") and environ.get("JAX_PLATFORMS", "") in ("", "tpu"):
        return "tpu-vm"
    return None


def initialize(coordinator_address=None, num_processes=None, process_id=None, force: bool | None = None) -> bool:
    """Join the other processes of this run (call before any other JAX call); returns whether it did.

    `force=None` joins when coordinates are given (`num_processes` > 1 or a coordinator address) or a launcher is
    detected (`detected_cluster`); `True` always joins (JAX detects what is not given); `False` never.
    """
    given = coordinator_address is not None or (num_processes or 1) > 1
    cluster = None if given or force is not None else detected_cluster()
    if force is False or (force is None and not given and cluster is None):
        return False
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    except Exception as e:
        reason = cause(e)
        if cluster == "tpu-vm":  # TPU chips outside a slice that JAX can read (e.g. Colab): one process, as before
            logging.warning("Running as a single process: jax.distributed found no TPU slice (%s).", reason)
            return False
        raise MotJaxError(
            f"Could not join the multi-process run ({reason}); on every process pass --coordinator_address=HOST:PORT "
            "(process 0's host) --num_processes=N --process_id=I, or start the processes with SLURM (srun) or on a "
            "Cloud TPU VM."
        ) from e
    return True


def is_main() -> bool:
    """Process 0: the one that writes logs, TensorBoard events and summaries."""
    return jax.process_index() == 0


def local_rows(mesh, batch_size: int) -> slice:
    """The rows of a global [batch_size, ...] batch (split over the mesh's `data` axis) that this process's devices
    hold: all of them in a single-process run."""
    index_map = NamedSharding(mesh, PartitionSpec("data")).addressable_devices_indices_map((batch_size,))
    rows = sorted({r for (index,) in index_map.values() for r in range(*index.indices(batch_size))})
    if not rows or rows != list(range(rows[0], rows[-1] + 1)):
        raise MotJaxError(
            f"Process {jax.process_index()} holds rows {rows} of each batch, not one contiguous block; build the mesh "
            "with each process's devices next to each other along `data` (mot_jax.sharding.make_mesh does)."
        )
    return slice(rows[0], rows[-1] + 1)


@contextlib.contextmanager
def prepare_lock(directory):
    """Serialise what runs inside among the processes of a multi-process run that share `directory`'s disk: the
    first builds the corpus, chunk tables and model caches, the others then find them ready. No-op for one process."""
    if jax.process_count() == 1:  # each cache build holds its own lock (paths.cache_lock) for any process
        yield
        return
    with file_lock(Path(directory) / ".prepare.lock"):
        yield


def check_shared(workdir):
    """Orbax writes each checkpoint from all processes into one directory, so all must see the same workdir (a shared
    file system, or gs://); stop, in every process alike, when one does not. No-op for one process."""
    if jax.process_count() == 1:
        return
    token = int(multihost_utils.broadcast_one_to_all(np.int32(random.randrange(2**31))))
    marker = workdir / f".shared-{token}"
    if is_main():
        marker.write_text("")
    multihost_utils.sync_global_devices("mot_jax: shared workdir marker written")
    seen = multihost_utils.process_allgather(np.asarray(marker.exists()))
    if is_main():
        marker.unlink()
    if not seen.all():
        raise MotJaxError(
            f"Processes {np.flatnonzero(~seen).tolist()} do not see the workdir {workdir} of process 0; a multi-host "
            "run needs a workdir on a shared file system or a gs://BUCKET/DIR path (pip install gcsfs)."
        )
