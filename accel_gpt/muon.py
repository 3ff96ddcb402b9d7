"""torch's Muon with its Newton-Schulz in the dtype this device does fast, and same-shaped matrices as one batch.

torch.optim.Muon (2.9 to at least 2.13) casts every update to bf16 before Newton-Schulz (`torch/optim/_muon.py`,
`_zeropower_via_newtonschulz`), which is 20x slower than fp32 where bf16 is emulated (`accel_gpt.precision`), and
orthogonalizes one matrix at a time. `Muon` is torch's class (its arguments, checks, groups and state_dict, so that a
checkpoint holds torch's Muon state) with one `step` of its own: the same arithmetic as torch's, op for op, with the
matrices of one shape stacked into one batched iteration in the dtype `NewtonSchulzPrecision` picks for that shape.
In bf16 it gives torch's bits (tested). Were a torch to give its Muon an option this step does not know, the class
falls back to torch's own step (bf16, one matrix at a time, its coefficients) and says so.

The iteration's coefficients are torch's quintic (the same three for every iteration) or Polar Express's (each
iteration its own): `ns_schedule`.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from accel_gpt.config import NSCoefficients
from accel_gpt.precision import NewtonSchulzPrecision

Coefficients = tuple[float, float, float]  # one iteration's a, b, c: x -> a x + b x^3 + c x^5 on singular values
# Polar Express (Amsel, Persson, Musco and Gower, 2025): iteration k's odd quintic is the one closest to 1 in the worst
# case over the range the iterations before it leave, starting from singular values in [POLAR_EXPRESS_LOW, 1] (after
# the update is divided by its Frobenius norm), each range widened upward by POLAR_EXPRESS_MARGIN first: a value that
# bf16 rounds past the top then stays bounded. Derived, and checked against this table, by bench/polar_express.py.
# After its 7 rows every value is within 0.2% of 1; iterations past the table repeat its last row.
POLAR_EXPRESS_LOW = 1e-3
POLAR_EXPRESS_MARGIN = 0.01
POLAR_EXPRESS = (
    (8.386893125263, -24.371310645207, 17.726411657077),
    (4.143011984778, -3.018617767436, 0.552650181073),
    (3.931188432822, -2.874113397761, 0.536722264435),
    (3.282797665109, -2.4165537064, 0.486530889182),
    (2.284974975355, -1.632360155867, 0.403066086969),
    (1.88227896218, -1.248529703556, 0.36655587531),
    (1.865701125896, -1.231457295988, 0.365756235117),
)
# The options of torch.optim.Muon this step implements (its `defaults`, torch 2.9 to 2.13).
KNOWN_OPTIONS = {"lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"}


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz runs in `precision`'s dtype per shape, a batch per shape."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        precision: NewtonSchulzPrecision,
        coefficients: NSCoefficients = "quintic",
        **options,
    ) -> None:
        super().__init__(params, **options)
        self.precision = precision
        self.coefficients = coefficients
        unknown = set(self.defaults) - KNOWN_OPTIONS
        # torch's own step where its Muon has changed: right, if slow
        self.fallback = f"torch {torch.__version__}'s Muon has options {sorted(unknown)}" if unknown else None

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if self.fallback:
            super().step()
            return
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params)

    def _update(self, group: dict, params: list[Tensor]) -> None:
        """torch's `_single_tensor_muon` for one group: momentum, Newton-Schulz, decoupled decay, the update."""
        lr, momentum = float(group["lr"]), group["momentum"]
        grads = [p.grad for p in params]
        for p in params:
            if p.grad.is_sparse or torch.is_complex(p):
                raise RuntimeError("Muon supports neither sparse gradients nor complex parameters")
        bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad)) for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        if group["weight_decay"]:  # a multiply by 1 is a pass over every matrix for nothing
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        schedule = ns_schedule(self.coefficients, group["ns_coefficients"], group["ns_steps"])
        for shape, index in same_shapes(params):
            stacked = torch.stack([updates[i] for i in index])
            dtype = self.precision.dtype_for(shape)
            ortho = orthogonalize(stacked, schedule, group["eps"], dtype)
            alpha = -adjusted_lr(lr, group["adjust_lr_fn"], shape)
            torch._foreach_add_([params[i] for i in index], list(ortho.unbind()), alpha=alpha)


def same_shapes(params: list[Tensor]) -> list[tuple[torch.Size, list[int]]]:
    """(shape, indices) of `params` of one shape and device, in order: each is orthogonalized as one batch."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        groups[(p.shape, p.device)].append(i)
    return [(shape, index) for (shape, _), index in groups.items()]


def ns_schedule(name: NSCoefficients, coefficients: Coefficients, steps: int) -> list[Coefficients]:
    """Each of `steps` iterations' (a, b, c): torch's `coefficients` every time (quintic), or Polar Express's rows."""
    if steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")  # torch's limit
    if name == "polar_express":
        return [POLAR_EXPRESS[min(k, len(POLAR_EXPRESS) - 1)] for k in range(steps)]
    if name == "quintic":
        return [tuple(coefficients)] * steps
    raise ValueError(f"Newton-Schulz coefficients {name!r}: not quintic or polar_express")


def orthogonalize(g: Tensor, schedule: list[Coefficients], eps: float, dtype: torch.dtype) -> Tensor:
    """(n, rows, cols) matrices -> their quintic Newton-Schulz orthogonalizations, one iteration per (a, b, c) of
    `schedule`, in `dtype`: torch's iteration (`_zeropower_via_newtonschulz`), batched. A tall matrix is iterated
    transposed, so the Gram matrix is the small side's. In fp32 a matrix over GRAM_FORM_RATIO times as long as wide
    takes `gram_form`, the same iteration in fewer operations."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm at most 1
    if dtype != torch.bfloat16 and x.size(-1) > GRAM_FORM_RATIO * x.size(-2):
        x = gram_form(x, schedule)
    else:
        for a, b, c in schedule:
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


# The long side over the short one past which `gram_form` costs less: for an (m, n) matrix and k >= 2 iterations it
# takes 2m^2n + (4k - 3)m^3 multiply-adds against the plain iteration's k(2m^2n + m^3), fewer once n > 1.5m.
GRAM_FORM_RATIO = 1.5


def gram_form(x: Tensor, schedule: list[Coefficients]) -> Tensor:
    """The Newton-Schulz iteration of wide (m, n) matrices (m < n) carried out on their (m, m) Gram matrices.

    Each iteration multiplies X by a polynomial Q of its Gram matrix G = X X^T, so X_k = P_k X_0 with P_k = Q_k ...
    Q_1, and G_{k+1} = Q_k G_k Q_k (the Q's and G's commute). Iterating on P and G costs 4 m^3 a step instead of
    2 m^2 n + m^3, and X_0 is multiplied once at the end: on nanoGPT's CPU recipe's matrices (128 by 384 or 512) a
    third to two fifths less time in fp32, agreeing with the plain iteration to 5e-5 (bf16's own error is 1e-2; the
    form is kept to fp32, where that holds: bench/RESULTS.md)."""
    gram = x @ x.mT
    p = None
    for k, (a, b, c) in enumerate(schedule):
        q = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        q.diagonal(dim1=-2, dim2=-1).add_(a)  # Q = aI + bG + cG^2
        p = q if p is None else q @ p
        if k < len(schedule) - 1:
            gram = q @ gram @ q
    return p @ x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch's per-matrix rate (`_adjust_lr`): original sqrt(max(1, rows/cols)), or match_rms_adamw's
    0.2 * sqrt(max(rows, cols))."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr
