"""How often a 2-process Gloo launch aborts at interpreter exit, without and with `release_group_at_exit`.

    OMP_NUM_THREADS=1 python bench/exit_abort.py                        # 40 launches per side, DDP case
    OMP_NUM_THREADS=1 python bench/exit_abort.py --case held --launches 20

Each launch starts two processes of this script (`--rank`) that form a Gloo group, end with the pattern of a
finished run (a last `broadcast_object_list`, as every rank's agreement on an error does, then
`destroy_process_group`) and exit. `--case ddp`: a DDP model held the group (as training does); `--case held`:
a module-level reference keeps the group to the end (as DTensor's caches do under FSDP).

- `bare`: torch alone, as before the fix. A Gloo worker thread still dropping the broadcast's tensors at
  finalization is refused the GIL and the process dies of SIGABRT ("terminate called without an active exception").
- `fixed`: `accel_gpt.runtime` imported before the group forms and `release_group_at_exit()` called once it has.

The sides alternate, one launch each, so that both meet the same machine load. Reported: aborted launches per side.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rank_main(rank: int, port: int, case: str, fixed: bool) -> None:
    if fixed:
        from accel_gpt.runtime import release_group_at_exit
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    del store
    if fixed:
        release_group_at_exit()
    if case == "held":
        globals()["KEPT"] = dist.group.WORLD

    def finish() -> None:
        if case == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
            model(torch.ones(2, 4)).sum().backward()
        box = [None if rank else "ok"]
        dist.broadcast_object_list(box, 0)
        dist.destroy_process_group()

    finish()


def launch(case: str, fixed: bool) -> bool:
    """One 2-process launch; True when a process aborted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, __file__, "--case", case, "--port", str(port)] + (["--fixed"] if fixed else [])
    procs = [subprocess.Popen([*args, "--rank", str(r)], stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    if any(code not in (0, -6) for code, _ in results):
        raise RuntimeError(f"a launch failed otherwise: {[(c, e[-500:]) for c, e in results]}")
    return any(code == -6 for code, _ in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["ddp", "held"], default="ddp")
    parser.add_argument("--launches", type=int, default=40, help="per side")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--fixed", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.case, args.fixed)
        return
    aborted = {"bare": 0, "fixed": 0}
    for i in range(args.launches):
        for side in ("bare", "fixed") if i % 2 == 0 else ("fixed", "bare"):
            aborted[side] += launch(args.case, side == "fixed")
    for side, n in aborted.items():
        print(f"case {args.case}, {side}: {n}/{args.launches} launches aborted at exit")


if __name__ == "__main__":
    main()
