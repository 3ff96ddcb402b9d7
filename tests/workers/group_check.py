"""Worker: build the Accelerator with `make_accelerator`, optionally pretending a GPU is present.

With `--pretend-gpu` on a CPU-only machine, accelerate gives each launched process its own 1-process state
(the Accelerator is not told `cpu=True`, so it never forms a gloo group); `make_accelerator` must refuse that
instead of training W independent copies.
"""

import sys

import accel_gpt.runtime as runtime

if "--pretend-gpu" in sys.argv:
    runtime.cpu_only = lambda: False  # Accelerator(cpu=False), as on a machine with GPUs


def check() -> None:
    accelerator = runtime.make_accelerator()
    # one write per line: the two ranks share the launcher's stdout
    sys.stdout.write(f"rank {accelerator.process_index} num_processes={accelerator.num_processes}\n")
    sys.stdout.flush()
    accelerator.end_training()


if __name__ == "__main__":
    from accel_gpt.errors import UserError

    try:
        check()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
