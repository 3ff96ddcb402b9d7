"""Derive the Polar Express coefficients of `accel_gpt.muon.POLAR_EXPRESS`, and check the table against them.

Newton-Schulz maps each singular value x of the (norm-scaled) update through an odd quintic a x + b x^3 + c x^5;
Muon wants every x in (0, 1] sent near 1. Polar Express (Amsel, Persson, Musco and Gower, 2025) picks each
iteration's quintic greedily: the one closest to 1 in the worst case over the interval [lo, hi] the values are known
to lie in (here widened upward by a margin, for bf16's rounding), then narrows the interval to that quintic's range
there. From [1e-3, 1], this script finds each minimax quintic by the Remez exchange (numpy only) and prints the
table; `--check` fails unless the table in accel_gpt/muon.py matches it to 1e-9.

    python bench/polar_express.py [--lo 1e-3] [--steps 7] [--margin 0.01] [--check]
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accel_gpt.muon import POLAR_EXPRESS, POLAR_EXPRESS_LOW, POLAR_EXPRESS_MARGIN


def quintic(coefficients: np.ndarray, x: np.ndarray) -> np.ndarray:
    a, b, c = coefficients
    return a * x + b * x**3 + c * x**5


def minimax_quintic(lo: float, hi: float, grid: int = 200_001, rounds: int = 60) -> tuple[np.ndarray, float]:
    """The odd quintic closest to 1 in the worst case over [lo, hi], and that worst error (Remez exchange).

    Three coefficients and the error are fixed by four points where the error alternates in sign; each round moves
    the points to the error's extremes on a fine grid, until the alternation is equal (the minimax one)."""
    x = np.geomspace(lo, hi, grid)
    points = np.geomspace(lo, hi, 4)
    for _ in range(rounds):
        signs = np.array([1.0, -1.0, 1.0, -1.0])
        system = np.stack([points, points**3, points**5, signs], axis=1)
        *coefficients, _level = np.linalg.solve(system, np.ones(4))
        error = 1 - quintic(coefficients, x)
        # one extreme of the error between each pair of its sign changes, the ends included
        edges = np.flatnonzero(np.diff(np.sign(error)) != 0) + 1
        pieces = np.split(np.arange(grid), edges)
        extremes = [piece[np.argmax(np.abs(error[piece]))] for piece in pieces if len(piece)]
        if len(extremes) != 4:
            break
        new = x[extremes]
        if np.allclose(new, points, rtol=1e-12):
            break
        points = new
    return np.array(coefficients), float(np.abs(1 - quintic(coefficients, x)).max())


def greedy_table(lo: float, steps: int, margin: float) -> list[tuple[float, float, float]]:
    """`steps` minimax quintics, each for the range the ones before it leave, widened upward by `margin`."""
    hi, table = 1.0, []
    for _ in range(steps):
        hi *= 1 + margin
        coefficients, error = minimax_quintic(lo, hi)
        values = quintic(coefficients, np.geomspace(lo, hi, 200_001))
        print(f"[{lo:.6f}, {hi:.6f}] -> {tuple(round(float(v), 12) for v in coefficients)}  worst |1 - p| {error:.3g}")
        table.append(tuple(float(v) for v in coefficients))
        lo, hi = float(values.min()), float(values.max())
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lo", type=float, default=POLAR_EXPRESS_LOW, help="the smallest singular value aimed at")
    parser.add_argument("--steps", type=int, default=len(POLAR_EXPRESS))
    parser.add_argument("--margin", type=float, default=POLAR_EXPRESS_MARGIN, help="each range widened upward by it")
    parser.add_argument("--check", action="store_true", help="fail unless accel_gpt.muon.POLAR_EXPRESS is this table")
    args = parser.parse_args()
    table = greedy_table(args.lo, args.steps, args.margin)
    if args.check:
        gap = np.abs(np.array(table) - np.array(POLAR_EXPRESS)).max()
        if gap > 1e-9:
            sys.exit(f"accel_gpt.muon.POLAR_EXPRESS differs from the derivation by {gap:.3g}")
        print(f"accel_gpt.muon.POLAR_EXPRESS matches (largest difference {gap:.2g})")


if __name__ == "__main__":
    main()
