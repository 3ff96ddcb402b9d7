"""Commands run as a user whom file permissions bind, each with one file or folder made unreadable or unwritable.

    python tests/workers/bound_by_permissions.py CASES.json RESULTS.json

CASES.json: a list of {"path": P, "mode": octal string, "argv": [command argv]}. For each case the worker sets P's
mode, runs `accel_gpt.cli.main(argv)` in this process, puts the mode back, and records the exit code and the
stderr's lines in RESULTS.json (a list in the same order).

Root reads and writes any file whatever its mode, so a worker started as root first gives up the two capabilities
that let it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): it stays the owner of the files, and the mode bits then hold
for it as for any user. It checks that they do before running a case.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accel_gpt.cli import main  # noqa: E402

CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_file_override() -> None:
    """As root: drop the capabilities that bypass file modes (capset(2)), then prove that a mode-000 file is shut."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        header, data = _Header(_LINUX_CAPABILITY_VERSION_3, 0), (_Data * 2)()
        if libc.capget(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capget")
        mask = ~((1 << CAP_DAC_OVERRIDE) | (1 << CAP_DAC_READ_SEARCH)) & 0xFFFFFFFF
        data[0].effective &= mask
        data[0].permitted &= mask
        if libc.capset(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capset")
    with tempfile.NamedTemporaryFile() as f:
        os.chmod(f.name, 0)
        try:
            open(f.name).close()
        except PermissionError:
            return
    raise SystemExit("file modes do not bind this process: the cases cannot be tested")


def run_case(case: dict) -> dict:
    path = Path(case["path"])
    before = path.stat().st_mode & 0o7777
    err = io.StringIO()
    code = 0
    os.chmod(path, int(case["mode"], 8))
    try:
        with contextlib.redirect_stderr(err):
            main(case["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:  # noqa: BLE001 - a traceback is what the test looks for
        code, err = -1, io.StringIO(f"{type(e).__name__}: {e}")
    finally:
        os.chmod(path, before)
    return {"code": code, "stderr": err.getvalue().splitlines()}


if __name__ == "__main__":
    drop_file_override()
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([run_case(case) for case in cases]))
