"""The two kinds of failure kiln reports, and the exit codes the CLI maps them to."""

from __future__ import annotations


class KilnError(Exception):
    """The work failed (a step, a quality gate, a server): exit code 1. The message says why and what next."""

    exit_code = 1


class InputError(KilnError):
    """Bad input from the user (recipe, paths, data, arguments): exit code 2, reported before heavy work."""

    exit_code = 2
