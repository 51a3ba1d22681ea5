"""The one exception type that entry points turn into a clear message and a non-zero exit."""


class MotJaxError(Exception):
    """Bad input from the user: the message names the problem and the fix in one sentence."""
