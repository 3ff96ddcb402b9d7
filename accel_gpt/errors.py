"""User-facing errors: the CLI prints their message as one line and exits non-zero, no traceback; and who says it."""

import os


class UserError(Exception):
    """Bad input from the person running a command (config, paths, data). Exit code 2."""


class ConfigError(UserError):
    """A config key, value or combination that cannot work."""


class DataError(UserError):
    """Missing, truncated or mismatched token shards, or an unusable dataset."""


class WindowError(DataError):
    """Bad data in the windows one process reads: only that rank meets it, so every rank that does says it."""


def is_main_rank() -> bool:
    """Rank 0 of a launch (RANK, set by torchrun) or a process started alone, read without building any state:
    what every rank meets is said by this one."""
    rank = os.environ.get("RANK", "0")
    return not rank.isdigit() or int(rank) == 0
