"""Any `run.py` command, with a record of what each rank writes to disk, prints and reads of the evaluation sets.

    accelerate launch ... tests/workers/rank_audit.py RECORD_DIR WATCHED_DIR -- COMMAND flags...

Every rank records, through Python's audit hooks, each file under WATCHED_DIR it opens for writing and each
rename, removal, copy and folder it makes there, and everything written to its `sys.stdout` and `sys.stderr`;
at exit it writes RECORD_DIR/rank_{rank}.json (RECORD_DIR outside WATCHED_DIR). `torch.save` and safetensors'
`save_file` write through native code that the hooks do not see: they are wrapped, before anything imports them.
The record also lists the val windows and HellaSwag rows the rank read, by index.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import safetensors.torch
import torch

record_dir, watched = Path(sys.argv[1]), Path(sys.argv[2]).resolve()
rank = int(os.environ.get("RANK", "0"))
writes: list[list[str]] = []
printed: dict[str, list[str]] = {"stdout": [], "stderr": []}
read: dict[str, list[int]] = {"val": [], "hellaswag": []}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
CHANGES = {"os.rename", "os.remove", "os.mkdir", "os.rmdir", "os.link", "os.symlink", "os.truncate"}
CHANGES |= {"shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copytree"}


def watched_path(value: Any) -> str | None:
    if not isinstance(value, (str, bytes, os.PathLike)):
        return None  # a file descriptor
    path = Path(os.fsdecode(value)).resolve()
    return str(path) if path == watched or watched in path.parents else None


def hook(event: str, args: tuple) -> None:
    if event == "open":
        path, mode, flags = (watched_path(args[0]), args[1], args[2])
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & WRITE_FLAGS)
        if path and writing:
            writes.append([event, path])
    elif event in CHANGES:
        paths = [p for p in map(watched_path, args[:2]) if p]
        if paths:
            writes.append([event, *paths])


class Recorded:
    """A text stream that records what is written to it, and passes it on."""

    def __init__(self, stream: TextIO, lines: list[str]) -> None:
        self._stream, self._lines = stream, lines

    def write(self, text: str) -> int:
        self._lines.append(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


sys.stdout = Recorded(sys.stdout, printed["stdout"])  # before anything imports logging or tqdm
sys.stderr = Recorded(sys.stderr, printed["stderr"])
sys.addaudithook(hook)


def recorded(save_fn: Any, name: str) -> Any:
    def save(obj: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        if watched_path(path):
            writes.append([name, watched_path(path)])
        return save_fn(obj, path, *args, **kwargs)

    return save


torch.save = recorded(torch.save, "torch.save")
safetensors.torch.save_file = recorded(safetensors.torch.save_file, "safetensors.save_file")


def save() -> None:
    record = {"writes": writes, "read": read, **{name: "".join(text) for name, text in printed.items()}}
    (record_dir / f"rank_{rank}.json").write_text(json.dumps(record))


def reading(dataset: Any, name: str, split: str | None = None) -> None:
    """Record the indices `dataset`'s objects are read at (only those of `split`, the second argument they were
    made with, if given)."""
    init, get = dataset.__init__, dataset.__getitem__

    def made(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.recorded = split is None or kwargs.get("split", args[1] if len(args) > 1 else None) == split

    def getitem(self: Any, i: int) -> Any:
        if self.recorded:
            read[name].append(int(i))
        return get(self, i)

    dataset.__init__, dataset.__getitem__ = made, getitem


atexit.register(save)
from accel_gpt.cli import main  # noqa: E402
from accel_gpt.data.loader import TokenWindows  # noqa: E402
from accel_gpt.evaluate.hellaswag import HellaSwagTokens  # noqa: E402

reading(TokenWindows, "val", split="val")
reading(HellaSwagTokens, "hellaswag")

main(sys.argv[sys.argv.index("--") + 1 :])
