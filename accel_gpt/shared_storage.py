"""One `out_dir` for every process: checked at start-up, and again at resume.

Every rank writes its own random-number state into each checkpoint and every rank reads the checkpoint back, so
the run needs `out_dir` to be one folder that all machines see (a shared file system). The same path on each
machine's own disk (a cloud VM without NFS, or launchers started in different working directories with a relative
`out_dir`) looks fine until a resume: then each machine finds other checkpoints, the ranks resume from different
steps, and the group hangs in its first collective. So a multi-process start proves the folder is shared: rank 0
writes a file with a random name, and every rank must see it (a few seconds of retries cover file systems whose
other clients see a new file late). A rank that does not is named in one line, with the fix.

At resume every rank looks up its checkpoint on its own; `agreement` compares what they found (the same folder,
the same files) and says in one line where they differ, before any rank loads anything.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from accel_gpt.errors import UserError

PROBE_PREFIX = ".shared-check-"
# How long a rank waits for rank 0's probe file to appear before it calls the folder unshared.
PROBE_PATIENCE_S = 10.0
FIX = (
    "put out_dir on storage that every machine mounts at the same path (NFS, Lustre, a cloud file store) and give "
    "it as an absolute path"
)


def check_shared_out_dir(out_dir: str | Path, accelerator: Accelerator) -> None:
    """Refuse, on every rank, an out_dir that is not one folder for all processes (see the module)."""
    if accelerator.num_processes == 1:
        return
    folder = Path(out_dir).absolute()
    box: list[str | None] = [None]
    created = False
    if accelerator.is_main_process:
        created = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        box[0] = f"{PROBE_PREFIX}{secrets.token_hex(8)}"
        (folder / box[0]).write_text(socket.gethostname())
    broadcast_object_list(box, from_process=0)  # also the barrier: the file exists before anyone looks
    seen = _appears(folder / box[0])
    views = gather_object([(accelerator.process_index, socket.gethostname(), seen)])
    if accelerator.is_main_process:
        (folder / box[0]).unlink(missing_ok=True)
        if created:
            _remove_if_empty(folder)
    blind = [(rank, host) for rank, host, seen in views if not seen]
    if blind:
        who = ", ".join(f"rank {rank} on {host}" for rank, host in blind[:4]) + (" ..." if len(blind) > 4 else "")
        raise UserError(
            f"out_dir {out_dir} is not one folder for every process: {who} cannot see a file that rank 0 "
            f"({views[0][1]}) wrote into it (a disk of each machine's own, or a relative path from another working "
            f"folder), so checkpoints would be split between machines; {FIX}"
        )


def _appears(path: Path) -> bool:
    deadline = time.monotonic() + PROBE_PATIENCE_S
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # another writer put something there: not ours to remove


@dataclass(frozen=True)
class View:
    """What one rank found to resume from: the checkpoint folder (None: none) and the names of its files."""

    rank: int
    host: str
    checkpoint: str | None
    files: tuple[str, ...] = ()


def view_of(accelerator: Accelerator, checkpoint: Path | None) -> View:
    files = tuple(sorted(os.listdir(checkpoint))) if checkpoint is not None else ()
    name = str(checkpoint.absolute()) if checkpoint is not None else None
    return View(accelerator.process_index, socket.gethostname(), name, files)


def gather_views(accelerator: Accelerator, checkpoint: Path | None) -> list[View]:
    mine = view_of(accelerator, checkpoint)
    return [mine] if accelerator.num_processes == 1 else gather_object([mine])


def agreement(views: list[View]) -> str | None:
    """None when every rank found the same checkpoint (or none) holding the same files; else the one line that
    says which ranks differ."""
    first = views[0]
    for view in views[1:]:
        if view.checkpoint != first.checkpoint:
            return (
                f"the processes would resume from different checkpoints: rank {first.rank} on {first.host} from "
                f"{first.checkpoint or 'none (step 0)'}, rank {view.rank} on {view.host} from "
                f"{view.checkpoint or 'none (step 0)'}: out_dir is not one folder for every machine; {FIX}"
            )
        if view.files != first.files:
            differ = sorted(set(first.files) ^ set(view.files))
            return (
                f"checkpoint {first.checkpoint} holds other files for rank {view.rank} on {view.host} than for rank "
                f"{first.rank} on {first.host} ({', '.join(differ[:3])}): out_dir is not one folder for every "
                f"machine; {FIX}"
            )
    return None
