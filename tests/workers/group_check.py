"""Worker: build the Accelerator as `make_accelerator` does, optionally pretending a GPU is present.

With `--pretend-gpu` on a CPU-only machine, accelerate gives each launched process its own 1-process state
(the trap in FACTS.md); `make_accelerator` must refuse that instead of training W independent copies.
"""

import sys

import accel_gpt.distributed as distributed

if "--pretend-gpu" in sys.argv:
    distributed.has_accelerator_device = lambda: True  # Accelerator(cpu=False), as on a machine with GPUs


def check() -> None:
    accelerator = distributed.make_accelerator()
    # one write per line: the two ranks share the launcher's stdout
    sys.stdout.write(f"rank {accelerator.process_index} num_processes={accelerator.num_processes}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    from accel_gpt.errors import UserError

    try:
        check()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
