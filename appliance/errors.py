"""Exit codes and the error a verb raises to end with one: the leaf every verb module imports.

Why its own module: the verb modules (install, fleet, the UI's) and cli.py's dispatcher all need these, and
holding them in cli.py made cli.py and install/cli.py import each other.
"""
from __future__ import annotations

EXIT_OK, EXIT_FAIL, EXIT_BAD = 0, 1, 2     # ok; failed (the box, not the input); bad input (what, where, fix)


class CliError(Exception):
    """A verb's refusal or failure: cli.main prints it as ``pdctl VERB: error: MSG`` and exits with ``code``."""

    def __init__(self, msg: str, code: int = EXIT_BAD):
        super().__init__(msg)
        self.code = code


class BenchError(ValueError):
    """Bad benchmark input (code 2) or an unreachable target (code 1): the message says what and how to fix."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code
