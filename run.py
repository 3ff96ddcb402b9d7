"""Entry point: `python run.py COMMAND ...` or `accelerate launch run.py train ...`."""

from accel_gpt.cli import main

if __name__ == "__main__":
    main()
