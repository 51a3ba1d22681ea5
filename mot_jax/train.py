"""Train a translator: `python -m mot_jax.train --config=configs/NAME.py[:tiny] --workdir=DIR [--config.key=value]`.

Restarting the same command on the same workdir resumes from its latest checkpoint.
"""

from __future__ import annotations

import logging as std_logging
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from mot_jax.errors import MotJaxError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/NAME.py[:ARG]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and TensorBoard events.")
flags.mark_flags_as_required(["config", "workdir"])
QUOTES = re.compile(r"""[\\'"]""")  # ml_collections quotes key names in its KeyError text


def parse_flags(argv):
    """absl's flag parsing, with a bad config file, argument or key reported in one line (exit 2)."""
    try:
        rest = flags.FLAGS(argv)
        _CONFIG.value.to_dict()  # a config file that failed to load raises only when its config is used
        return rest
    except Exception as e:  # config files run user code: any error there is a usage error
        reason = " ".join(str(e.args[0] if e.args else e).replace("\\n", " ").split())
        if isinstance(e, AttributeError | KeyError):
            reason = f"the config has no key {QUOTES.sub('', reason)}"
            reason += " (mot_jax/training/config.py lists every key)"
        print(f"error: {reason}", file=sys.stderr)
        sys.exit(2)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.INFO)
    # Orbax logs every save step at INFO through absl; keep its warnings and errors only
    logging.get_absl_handler().addFilter(lambda r: r.levelno >= std_logging.WARNING or "/orbax/" not in r.pathname)
    from mot_jax.training.loop import train_and_evaluate  # after flag parsing: importing jax is slow

    try:
        train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except MotJaxError as e:
        logging.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run():
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
