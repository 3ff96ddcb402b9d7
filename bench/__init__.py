"""Benchmarks of accel_gpt, run as scripts (`python bench/NAME.py`); figures in bench/RESULTS.md."""
