"""Evaluation: validation loss and HellaSwag, exact under any number of processes.

`evaluator.Evaluator` runs them (and a text sample) at their cadences during training; `command.run_eval`
is `run.py eval`.
"""
