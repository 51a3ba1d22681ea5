"""What the absl entry points share: one-line errors for bad flags and configs, and for MotJaxError at run time."""

from __future__ import annotations

import logging as std_logging
import os
import re
import signal
import sys
import threading

import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from mot_jax.errors import MotJaxError, Terminated

HELP = {"-?", "-help", "--help", "--helpshort", "--helpfull", "--helpxml"}  # absl's help flags
QUOTES = re.compile(r"""[\\'"]""")  # ml_collections quotes key names in its KeyError text


def log_info_quietly():
    """absl INFO logs, without Orbax's INFO lines (it logs every save and restore step) or its tracebacks (the error
    reaches the caller, which reports it in one line); its warnings stay."""
    logging.set_verbosity(logging.INFO)
    quiet = lambda r: "/orbax/" in r.pathname and (r.levelno < std_logging.WARNING or r.exc_info)
    logging.get_absl_handler().addFilter(lambda r: not quiet(r))


def config_error(e: Exception, keys_listed_in: str) -> str:
    """One line for an exception raised while reading a config or its overrides."""
    reason = " ".join(str(e.args[0] if e.args else e).replace("\\n", " ").split())
    if isinstance(e, AttributeError | KeyError):
        reason = f"the config has no key {QUOTES.sub('', reason)} ({keys_listed_in} lists every key)"
    return reason


FILE_PARSER = config_flags.config_flags.ConfigFileFlagParser  # the parser of a --config=FILE.py flag
# ml_collections' stand-in for a config file it could not read (it raises when the config is used)
UNREAD = getattr(config_flags.config_flags, "_ErrorConfig", ())


def only_config_dicts(config_flag, keys_listed_in: str):
    """Make the --config file flag refuse, as it is parsed, a `get_config()` that returns no ConfigDict: every later
    read of it (its overrides, the config's check) would say the config has no such key."""
    flag = flags.FLAGS[config_flag.name]
    if not isinstance(flag.parser, FILE_PARSER):
        return  # a config dict defined in code (mot_jax.evaluate's)
    load = flag.parser.parse

    def parse(path):
        config = load(path)
        if not isinstance(config, ml_collections.ConfigDict | UNREAD):
            file, colon, arg = path.partition(":")
            what = "None" if config is None else f"{type(config).__name__} {config!r:.60}"
            raise MotJaxError(
                f"get_config({repr(arg) if colon else ''}) of the config file {file} returned {what}, "
                f"not an ml_collections.ConfigDict; return the config (the files in configs/ start it from base() "
                f"in {keys_listed_in})."
            )
        return config

    flag.parser.parse = parse


def _not_returned_none(record) -> bool:
    """ml_collections' warning about a get_config() that returned None (refused, in one line, by
    `only_config_dicts`)."""
    return "did you forget a return statement" not in record.getMessage()


def config_flags_parser(config_flag, keys_listed_in: str):
    """absl's flag parsing, with a bad config file, argument or key reported in one line (exit 2)."""
    only_config_dicts(config_flag, keys_listed_in)
    logging.get_absl_logger().addFilter(_not_returned_none)

    def parse(argv):
        try:
            try:
                rest = flags.FLAGS(argv)
            except SystemExit:  # absl exits 1 after printing the help that --help asked for
                if any(a.split("=")[0] in HELP for a in argv[1:]):
                    sys.exit(0)
                raise
            config_flag.value.to_dict()  # a config file that failed to load raises only when its config is used
            return rest
        except Exception as e:  # config files run user code: any error there is a usage error
            path = missing_config_file(config_flag)
            if path:  # ml_collections' message for it repeats itself, in pieces
                fail(f"the config file {path} does not exist; pass --config=FILE.py[:ARG] (configs/ has them).")
            fail(config_error(e, keys_listed_in))

    return parse


def flags_parser(argv):
    """absl's flag parsing for a command without a --config, with a missing or bad flag reported in one line (exit 2);
    absl printed it as FATAL with a pointer to the help and exited 1."""
    try:
        return flags.FLAGS(argv)
    except SystemExit:  # absl exits 1 after printing the help that --help asked for
        if any(a.split("=")[0] in HELP for a in argv[1:]):
            sys.exit(0)
        raise
    except flags.Error as e:
        fail(str(e))


def missing_config_file(config_flag) -> str | None:
    """The --config file's path when that file does not exist."""
    try:
        path = config_flags.get_config_filename(flags.FLAGS[config_flag.name]).split(":")[0]
    except Exception:  # not given, or not parsed
        return None
    return None if os.path.isfile(path) else path


def no_arguments(argv):
    """Refuse, in one line, words after the command that are not flags (absl hands them to `main` in `argv`); absl's
    UsageError printed the whole usage and exited 1."""
    if len(argv) > 1:
        words = " ".join(map(repr, argv[1:]))
        fail(f"unexpected argument{'s' * (len(argv) > 2)} {words}; pass options as --name=value (--help lists them).")


def fail(message: str, status: int = 2):
    """Report bad input in one line and exit with `status` (2)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


def _terminate(signum, frame):
    raise Terminated


def run_or_exit(fn, *args, **kwargs):
    """Run `fn`; a MotJaxError (bad input, explained in one sentence) ends the program in one line (exit 2, or the
    error's `exit_status`), and so do Ctrl-C (130) and SIGTERM (143), which `fn` sees as a KeyboardInterrupt (to
    checkpoint before it stops)."""
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set a signal handler
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return fn(*args, **kwargs)
    except MotJaxError as e:
        fail(str(e), getattr(e, "exit_status", 2))
    except Terminated:
        fail("terminated (SIGTERM)", 128 + signal.SIGTERM)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
