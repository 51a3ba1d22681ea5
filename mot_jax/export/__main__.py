"""Export a trained translator for PyTorch: `python -m mot_jax.export --workdir=DIR --out=OUT [--which=last|best|STEP]`.

OUT gets `model.safetensors` (the experts and routers, projector MLPs, linear skips, C2C fusers or LSC translators,
and RoPE tables; no pickle) and `config.json` (the translator's shape, channel map, mode and dial switches, and the
training run's model names and alignment settings), and the marker `.mot_jax_output` that lets a later export
replace it (`mot_jax.outputs`: never a workdir or a folder of other files). Load it with
`mot_jax.export.torch_translator.KVTranslator.from_pretrained(OUT)` (torch only); `mot_jax.export.torch_pipeline`
drives transformers models with it.
"""

from __future__ import annotations

from absl import app, flags, logging

from mot_jax.cli import flags_parser, no_arguments, run_or_exit
from mot_jax.errors import MotJaxError, cause

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir holding a finished checkpoint.")
_OUT = flags.DEFINE_string("out", None, "Output folder (new, empty, or an earlier export, which it replaces).")
_WHICH = flags.DEFINE_string("which", "last", "The checkpoint: last, best (validation loss) or a step number.")
flags.mark_flags_as_required(["workdir", "out"])


def export_workdir(workdir, out, which="last"):
    from mot_jax.export import weights
    from mot_jax.outputs import check_output, write_fix
    from mot_jax.training.trained import load_trained

    check_output(out, weights.TOOL)  # before the checkpoint is read
    trained = load_trained(workdir, which)
    c = trained.config
    extra = dict(
        source=c.source,
        target=c.target,
        source_length=c.data.source_length,
        dtype=c.dtype,
        step=trained.step,
        channel_map=trained.meta["channel_map"],
        trained_steps=c.steps,
    )
    try:
        return weights.export(trained.translator, trained.source_config, trained.target_config, out, extra), trained
    except OSError as e:  # a full disk, a folder made read-only meanwhile: nothing changed at `out`
        raise MotJaxError(f"Could not write the export to {out} ({cause(e)}); {write_fix(e)} and rerun.") from None


def main(argv):
    no_arguments(argv)
    logging.set_verbosity(logging.WARNING)  # Orbax reports every read at INFO
    out, trained = run_or_exit(export_workdir, _WORKDIR.value, _OUT.value, _WHICH.value)
    print(
        f"exported the translator of step {trained.step} ({trained.config.source} -> {trained.config.target}, "
        f"{trained.translator.spec.mode}) to {out}"
    )


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser)
