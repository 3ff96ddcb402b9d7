"""User-facing errors: the CLI prints their message as one line and exits non-zero, no traceback; and who says it."""

import os


class UserError(Exception):
    """Bad input from the person running a command (config, paths, data). Exit code 2."""


class ConfigError(UserError):
    """A config key, value or combination that cannot work."""


class StartRefused(UserError):
    """A new run that cannot go on, found in its first steps before anything was saved (a time budget shorter than
    a step): the files its start wrote are taken back, so that the command its message advises runs."""


class DataError(UserError):
    """Missing, truncated or mismatched token shards, or an unusable dataset."""


class WindowError(DataError):
    """Bad data in the windows one process reads: only that rank meets it, so every rank that does says it."""


def is_main_rank() -> bool:
    """Rank 0 of a launch (RANK, set by torchrun) or a process started alone, read without building any state:
    what every rank meets is said by this one."""
    rank = os.environ.get("RANK", "0")
    return not rank.isdigit() or int(rank) == 0
