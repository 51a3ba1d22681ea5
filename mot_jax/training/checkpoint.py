"""Orbax checkpoints of a training run, behind one small class (a move to another Orbax API touches this file).

A checkpoint holds the trainable state (translator params, optimizer state, RNG) as arrays and, as JSON, the step,
the input position, the resolved channel map, the config and the experiment's identity (model pair and translator
shape). `workdir/checkpoints` keeps the last K; `workdir/best` keeps the one with the lowest validation loss.
Saves are asynchronous: a failed one raises (MotJaxError, naming the cause and the last checkpoint on disk) from the
next `save`, `check` or `close`; `close()` waits for them.
"""

from __future__ import annotations

import contextlib
import json
import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from mot_jax.errors import MotJaxError, cause, root_cause
from mot_jax.files import strict_json
from mot_jax.training import saved

# what the training loop and load_trained read from a checkpoint's meta (every saved version has them)
META_KEYS = ("step", "channel_map", "identity", "config", "initial_validation", "best_validation_loss")


def _manager(path, keep: int, create: bool) -> ocp.CheckpointManager:
    # the two managers save the same step at once: Orbax's barriers between processes are named by the step, so each
    # manager needs its own prefix or the processes of a multi-process run meet in the wrong barrier and hang
    processes = ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=path.name)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=create, enable_async_checkpointing=True, multiprocessing_options=processes
    )
    return ocp.CheckpointManager(path, options=options)


def finite(state):
    """A traced bool: every float array of `state` is finite (the train step's check, and `all_finite`'s)."""
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in floats]))


_all_finite = jax.jit(finite)


def all_finite(state) -> bool:
    """Whether every float array of `state` (params, optimizer moments) is finite: a finite loss does not say so
    (moments that overflowed leave the parameters and the loss finite, and the next update NaN)."""
    return bool(_all_finite(state))


def quiet_orbax_reads():
    """After a failed restore, the reads of the other arrays that Orbax had started fail alike and print their
    tracebacks when collected ("Exception ignored in: <coroutine ... _read_array_index_and_device_put>"), dozens of
    lines after the one-line error: from then on such reads' unraisable errors are dropped, all others still shown."""
    hook = sys.unraisablehook
    if getattr(hook, "quiets_orbax_reads", False):
        return

    def quiet(unraisable):
        if getattr(unraisable.object, "__qualname__", "") != "_read_array_index_and_device_put":
            hook(unraisable)

    quiet.quiets_orbax_reads = True
    sys.unraisablehook = quiet


class Checkpoints:
    def __init__(self, workdir, keep: int, create: bool = True):
        """`create=False` opens an existing run read-only (no folders are made)."""
        self.workdir = workdir  # an absolute etils.epath.Path (local or gs://)
        self.last = _manager(self.workdir / "checkpoints", keep, create)
        self.best = _manager(self.workdir / "best", 1, create)

    def latest_step(self) -> int | None:
        return self.last.latest_step()

    def save(self, step: int, state, meta: dict, best: bool = False):
        """Save `state` at `step` (in the background); a state that is not finite is never saved (MotJaxError)."""
        if not all_finite(state):
            raise MotJaxError(f"The state of step {step} holds NaN or inf; it was not saved in {self.workdir}.")
        # Orbax writes the meta with Python's json, a non-finite float as a bare Infinity or NaN that JSON does not
        # allow (best_validation_loss before the first validation): written as null, as every JSON file here
        meta = json.loads(strict_json(meta))
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        with self._saving():
            self.last.save(step, args=args, force=True)
            if best:
                self.best.save(step, args=args, force=True)

    def check(self):
        """Raise the error of a background save that has failed (cheap; call it every step)."""
        with self._saving():
            self.last.check_for_errors()
            self.best.check_for_errors()

    @contextlib.contextmanager
    def _saving(self):
        try:
            yield
        except MotJaxError:
            raise
        except Exception as e:  # a full disk, lost permissions, a cloud bucket's error
            self.last.reload()
            kept = self.last.latest_step()
            kept = f"the last checkpoint is step {kept}" if kept else "no checkpoint was written"
            raise MotJaxError(
                f"Saving a checkpoint in {self.workdir} failed ({type(e).__name__}: {cause(e)}); stopped, {kept}. "
                "Free space (or fix the folder) and run the same command to resume."
            ) from None

    def read_meta(self, step: int | None = None, which: str = "last") -> dict:
        manager = self.best if which == "best" else self.last
        step = manager.latest_step() if step is None else step
        try:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            missing = [k for k in META_KEYS if k not in meta]
        except Exception as e:
            raise self._unreadable(manager, step, e) from None
        if missing:
            raise self._unreadable(
                manager, step, f"its meta has no {', '.join(missing)}: written by another version or program"
            )
        return saved.upgrade_meta(meta)  # as today's version writes it

    def restore(self, state, step: int | None = None, which: str = "last"):
        """The saved arrays in the structure, dtypes and shardings of `state` (a live or abstract pytree); leaves
        without a sharding land on this process's first device, whatever devices (or processes) saved them."""
        manager = self.best if which == "best" else self.last
        step = manager.latest_step() if step is None else step
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        abstract = jax.tree.map(lambda x: x if x.sharding else x.update(sharding=device), abstract)
        try:
            return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:
            raise self._unreadable(manager, step, e) from None

    def _unreadable(self, manager, step, error):
        if not isinstance(error, str):
            quiet_orbax_reads()
            error = root_cause(error)
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {cause(error)[:300]}"
        return MotJaxError(
            f"The checkpoint of step {step} in {manager.directory} cannot be read ({reason}); delete that step's "
            "folder to fall back to an earlier one, or use a new --workdir."
        )

    def close(self):
        """Wait for the saves in flight (raising if one failed) and stop Orbax's threads, whatever happens."""
        try:
            with self._saving():
                self.last.wait_until_finished()
                self.best.wait_until_finished()
        finally:
            for manager in (self.last, self.best):
                try:
                    manager.close()
                except Exception:  # a failed save, raised again as Orbax stops: `_saving` has said it in one line
                    pass
