"""Log-depth Mobius scan: prefix products of 2x2 matrices by odd-even (Ladner-Fischer) recursion.

The map x -> (A x + B) / (C x + D) is the matrix M = [[A, B], [C, D]] acting on the projective
vector (x, 1); composing maps multiplies matrices, so x_t = (M_t ... M_1)(x_0). The prefix
products are formed in O(T) work and 2 log2(T) sequential rounds of elementwise torch ops:
combine neighbours (M_2 M_1, M_4 M_3, ...), scan those pairs recursively, then fill in the even
positions with one more product each.

Range: a product of T matrices grows or shrinks like the product of their scales (for KDN,
T = 10^6 steps with evidence 10^4 each reaches 10^(4 10^6)). The map is scale-invariant, so every
product is divided by the sum of its entries; with non-negative entries nothing cancels, and
each entry of a prefix product keeps a relative error of about (4 log2 T) * eps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Maps = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _normalize(maps: Maps) -> Maps:
    a, b, c, d = maps
    # Any positive factor may divide the matrix without changing the map. Detaching it keeps
    # gradients exact: for a scale-invariant f, d/dM f(M / s) at fixed s equals d/dM f(M).
    total = (a + b + c + d).detach().clamp_min(torch.finfo(a.dtype).tiny)
    return a / total, b / total, c / total, d / total


def _compose(later: Maps, earlier: Maps) -> Maps:
    """The map `later o earlier` (matrix product later @ earlier), renormalized."""
    a2, b2, c2, d2 = later
    a1, b1, c1, d1 = earlier
    return _normalize((a2 * a1 + b2 * c1, a2 * b1 + b2 * d1, c2 * a1 + d2 * c1, c2 * b1 + d2 * d1))


def _take(maps: Maps, index: slice) -> Maps:
    a, b, c, d = (x[..., index] for x in maps)
    return a, b, c, d


def _interleave(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """Positions 0, 2, 4, ... from `even` and 1, 3, ... from `odd` along the last axis."""
    length = even.shape[-1] + odd.shape[-1]
    odd = F.pad(odd, (0, even.shape[-1] - odd.shape[-1]))
    return torch.stack([even, odd], dim=-1).flatten(-2)[..., :length]


def _prefix_products(maps: Maps) -> Maps:
    """Normalized M_t ... M_1 for every t, along the last axis."""
    length = maps[0].shape[-1]
    if length == 1:
        return maps
    even, odd = _take(maps, slice(0, None, 2)), _take(maps, slice(1, None, 2))
    n_even, n_odd = even[0].shape[-1], odd[0].shape[-1]
    at_odd = _prefix_products(_compose(odd, _take(even, slice(0, n_odd))))
    # Position 2i (i >= 1) is M_2i after the prefix ending at 2i - 1; position 0 is M_0 itself.
    tail = _compose(_take(even, slice(1, None)), _take(at_odd, slice(0, n_even - 1)))
    at_even = tuple(torch.cat([e[..., :1], t], dim=-1) for e, t in zip(even, tail, strict=True))
    a, b, c, d = (_interleave(e, o) for e, o in zip(at_even, at_odd, strict=True))
    return a, b, c, d


def mobius_scan_parallel(
    A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, x0: torch.Tensor
) -> torch.Tensor:
    """All iterates of the per-step maps by a log-depth scan.

    A, B, C, D: `[..., T]` (validated, non-negative, one dtype); x0: `[...]` (>= 0).
    Returns x_1..x_T `[..., T]`.
    """
    prefixes = _prefix_products(_normalize((A, B, C, D)))
    return apply_map(prefixes, x0.unsqueeze(-1))


def apply_map(maps: Maps, x0: torch.Tensor) -> torch.Tensor:
    """The maps `(a, b, c, d)` applied to x0 (>= 0, broadcast against them)."""
    a, b, c, d = maps
    # (x0, 1) scaled to entries <= 1 (again exact for gradients), so that a huge x0 cannot
    # overflow and x0 = 0 needs no special case: x = (a v0 + b v1) / (c v0 + d v1).
    size = x0.detach().clamp_min(1.0)
    v0, v1 = x0 / size, 1.0 / size
    return (a * v0 + b * v1) / (c * v0 + d * v1)


def compose(later: Maps, earlier: Maps) -> Maps:
    """The map `later o earlier`, renormalized (entries >= 0)."""
    return _compose(later, earlier)


def span_map(maps: Maps) -> Maps:
    """The composed map `M_T ... M_1` of the steps along the last axis `[..., T]`, renormalized:
    pairs of neighbours composed until one is left (O(T) work, log2(T) rounds)."""
    maps = _normalize(maps)
    while maps[0].shape[-1] > 1:
        length = maps[0].shape[-1]
        even, odd = _take(maps, slice(0, None, 2)), _take(maps, slice(1, None, 2))
        paired = _compose(odd, _take(even, slice(0, length // 2)))
        if length % 2:
            last = _take(even, slice(-1, None))
            paired = tuple(torch.cat([p, x], dim=-1) for p, x in zip(paired, last, strict=True))
        maps = paired  # type: ignore[assignment]
    a, b, c, d = (x[..., 0] for x in maps)
    return a, b, c, d
