"""The training window stream: epoch after epoch of seeded permutations, entered at any position.

A run longer than one pass over its data goes on into epoch 1, 2, ... without a gap or a repeat of epoch 0's
order, and a resume at position p must yield exactly what an uninterrupted stream yields from p on.
"""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader

from accel_gpt.data.loader import WindowSampler

N, SEED = 5, 3


def take(sampler: WindowSampler, n: int) -> list[int]:
    return list(itertools.islice(iter(sampler), n))


def epoch_order(epoch: int) -> list[int]:
    """Epoch e's order as the sampler defines it: torch.randperm seeded by (seed, epoch)."""
    return torch.randperm(N, generator=torch.Generator().manual_seed(SEED * 100_003 + epoch)).tolist()


def test_stream_wraps_into_the_next_epochs_permutation() -> None:
    e0, e1, e2 = epoch_order(0), epoch_order(1), epoch_order(2)
    assert sorted(e0) == sorted(e1) == sorted(e2) == list(range(N))
    assert e0 != e1 and e1 != e2, "each epoch is shuffled anew"
    assert take(WindowSampler(N, SEED), 12) == e0 + e1 + e2[:2]


def test_stream_from_any_position_is_the_tail_of_the_stream() -> None:
    """A resume sets `start`; from inside epoch 0, on the boundary, or epochs later, it continues the same stream."""
    whole = take(WindowSampler(N, SEED), 4 * N)
    for start in (0, 3, N - 1, N, N + 2, 2 * N, 3 * N - 1):
        assert take(WindowSampler(N, SEED, start=start), 4 * N - start) == whole[start:], start
    assert take(WindowSampler(N, SEED, start=N + 2), 3) == epoch_order(1)[2:]


def test_a_batch_straddles_the_epoch_boundary() -> None:
    """With 5 windows and batches of 2, the third batch is epoch 0's last window and epoch 1's first: the endless
    stream drops nothing at the boundary, whatever `drop_last` says (it only applies where a stream ends)."""
    loader = DataLoader(list(range(N)), sampler=WindowSampler(N, SEED), batch_size=2, drop_last=True)
    batches = [b.tolist() for b in itertools.islice(iter(loader), 5)]
    e0, e1 = epoch_order(0), epoch_order(1)
    assert batches == [e0[0:2], e0[2:4], [e0[4], e1[0]], e1[1:3], e1[3:5]]
