"""What the absl entry points share: one-line errors for bad flags and configs, and for MotJaxError at run time."""

from __future__ import annotations

import logging as std_logging
import re
import sys

from absl import flags, logging

from mot_jax.errors import MotJaxError

QUOTES = re.compile(r"""[\\'"]""")  # ml_collections quotes key names in its KeyError text


def log_info_quietly():
    """absl INFO logs, without Orbax's INFO lines (it logs every save and restore step); its warnings stay."""
    logging.set_verbosity(logging.INFO)
    logging.get_absl_handler().addFilter(lambda r: r.levelno >= std_logging.WARNING or "/orbax/" not in r.pathname)


def config_error(e: Exception, keys_listed_in: str) -> str:
    """One line for an exception raised while reading a config or its overrides."""
    reason = " ".join(str(e.args[0] if e.args else e).replace("\\n", " ").split())
    if isinstance(e, AttributeError | KeyError):
        reason = f"the config has no key {QUOTES.sub('', reason)} ({keys_listed_in} lists every key)"
    return reason


def config_flags_parser(config_flag, keys_listed_in: str):
    """absl's flag parsing, with a bad config file, argument or key reported in one line (exit 2)."""

    def parse(argv):
        try:
            rest = flags.FLAGS(argv)
            config_flag.value.to_dict()  # a config file that failed to load raises only when its config is used
            return rest
        except Exception as e:  # config files run user code: any error there is a usage error
            fail(config_error(e, keys_listed_in))

    return parse


def fail(message: str):
    """Report bad input in one line and exit with 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def run_or_exit(fn, *args, **kwargs):
    """Run `fn`; a MotJaxError (bad input, explained in one sentence) is logged and ends the program (exit 2)."""
    try:
        return fn(*args, **kwargs)
    except MotJaxError as e:
        logging.error("%s", e)
        fail(str(e))
