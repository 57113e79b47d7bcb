"""The sampler's draw: a Gumbel-max race keyed by (the draw's key, token id).

A draw picks `argmax_i(score_i + G_i)` over the candidate tokens, where `score_i` is the
token's tempered logit (`logit / T`, or the log of a given probability) and
`G_i = -log(-log U_i)` is standard Gumbel noise. The argmax of Gumbel-perturbed
log-probabilities is a sample of their softmax (Gumbel 1954; the "Gumbel-max trick", e.g.
Maddison, Tarlow and Minka 2014, "A* Sampling"), and the argmax over any subset of the
tokens is a sample of the distribution restricted to that subset and renormalised (a
constrained draw: the best perturbed score among the allowed tokens).

Why not the inverse of the cumulative sum at one uniform number (the draw before): a
change of ~1e-4 in any probability before the drawn index moves every later boundary, so
the same seed drew another token when the prompt's last positions were computed by another
path (a prefix-cache hit, a batch of other rows, a pipeline or tensor split). The race
only changes its answer when two candidates' perturbed scores lie within the logits'
change of each other.

`U_i` comes from a counter-based hash, not a generator's stream: the 32-bit half
`token_id % 2` (0: the low one) of splitmix64's output for the seed `key` at counter
`token_id // 2 + 1` (Steele, Lea and Flood 2014, "Fast Splittable Pseudorandom Number
Generators", with the constants of Vigna's splitmix64; one 64-bit hash serves two
neighbouring tokens, which halves the hashing), so a token's noise is the same whatever the
filters (top-k, top-p, min-p) left and wherever it sits in the candidate list. Counter 0 is
the draw's own uniform number (`key_uniform`: the speculative acceptance test). The top 31
bits `m` of the token's 32 make the exponential `E = -log(U)`: for `m < 2**29` as
`-log1p(-W)`, `W = (m + 0.5) / 2**31`, else as `-log(V)`, `V = (2**31 - 1 - m + 0.5) / 2**31`
(the same `U = 1 - W`), so the small `E` of the likely winners keep float32's relative
precision; then `G = -log(E)`.

Every float operation is one IEEE float32 add, multiply or divide (no fused multiply-add,
no library log: the log is a float32 atanh series of our own, `_log`), so the torch code
here and the native kernel (`quant/native/gumbel_race.cpp`: 512-bit, 256-bit and scalar
paths) give the same perturbed scores bit for bit on every CPU (CUDA runs the same torch
operators; not checked on a GPU). Speed (figures: docs/benchmarks/2026-12-07-gumbel-race.md):
the native kernel on CPUs where exo's kernels are built, else these torch operators (~20x
slower over a whole vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

MASK64 = (1 << 64) - 1
# splitmix64's increment (the golden ratio's 64-bit fraction) and its two mixing multipliers.
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB
# Hashes below this (of 2**31) give E through log1p(-W) (W < 1/4, so 1 - W >= sqrt(1/2)).
SMALL_HASH = 1 << 29
# float32 constants (exact as Python floats): the atanh series' 1/3, 1/5, 1/7, 1/9, ln 2,
# and sqrt(2)'s mantissa bits (above it a mantissa is halved so it stays in [0.71, 1.42)).
THIRD = float.fromhex("0x1.555556p-2")
FIFTH = float.fromhex("0x1.99999ap-3")
SEVENTH = float.fromhex("0x1.24924ap-3")
NINTH = float.fromhex("0x1.c71c72p-4")
LN2 = float.fromhex("0x1.62e430p-1")
SQRT2_MANTISSA = 0x3504F3
INV_2_31 = float.fromhex("0x1p-31")

GumbelKernel = Callable[[torch.Tensor, torch.Tensor | None, int, int], torch.Tensor]


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def splitmix64(key: int, counter: int) -> int:
    """splitmix64's output number `counter` for seed `key` (unsigned 64-bit ints)."""
    z = (key + counter * GOLDEN_GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * MIX_1) & MASK64
    z = ((z ^ (z >> 27)) * MIX_2) & MASK64
    return z ^ (z >> 31)


def key_uniform(key: int) -> float:
    """The draw's uniform number in [0, 1) (53 bits): the hash at counter 0, which no token
    uses (the speculative acceptance test, `Sampler.next_uniform`)."""
    return (splitmix64(key, 0) >> 11) * 2.0**-53


def draw_key(generator: torch.Generator) -> int:
    """A draw's key: 63 random bits from the request's generator (one per draw)."""
    device = generator.device
    return int(torch.empty((), dtype=torch.int64, device=device).random_(generator=generator))


def _shift_right(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 `values` (torch's `>>` is arithmetic)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def _hash31(key: int, ids: torch.Tensor) -> torch.Tensor:
    """Per id `[n]` int64: the top 31 bits of the 32-bit half `id % 2` (0: low) of
    splitmix64(key, id // 2 + 1), as int64 `[n]`."""
    z = (_shift_right(ids, 1) + 1) * _signed(GOLDEN_GAMMA) + _signed(key)
    z = (z ^ _shift_right(z, 30)) * _signed(MIX_1)
    z = (z ^ _shift_right(z, 27)) * _signed(MIX_2)
    z = z ^ _shift_right(z, 31)
    high = (ids & 1).bool()
    return torch.where(high, _shift_right(z, 33), (z & 0xFFFFFFFF) >> 1)


def _log1p_reduced(f: torch.Tensor) -> torch.Tensor:
    """log(1 + f) for float32 `f` in [sqrt(1/2) - 1, sqrt(2) - 1]: 2 atanh(s), s = f / (2 + f),
    |s| <= 0.172, as 2s (1 + s^2/3 + s^4/5 + s^6/7 + s^8/9) (the next term is < 2**-28 of it).
    One rounding per operation, in the native kernel's order."""
    s = f / (f + 2.0)
    z = s * s
    series = (((z * NINTH + SEVENTH) * z + FIFTH) * z + THIRD) * z
    twice = s + s
    return twice + twice * series


def _reduce(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positive normal float32 `x` as `2**e * (1 + f)`, `1 + f` in [sqrt(1/2), sqrt(2)]:
    (`e` float32, `f` float32, exact)."""
    bits = x.view(torch.int32)
    exponent = (bits >> 23) - 127
    mantissa = bits & 0x7FFFFF
    big = (mantissa > SQRT2_MANTISSA).to(torch.int32)
    exponent = exponent + big
    reduced = ((mantissa | 0x3F800000) - (big << 23)).view(torch.float32)
    return exponent.to(torch.float32), reduced - 1.0


def _log(x: torch.Tensor) -> torch.Tensor:
    """log(x) for positive normal float32 `x` (within a few float32 ulps)."""
    exponent, f = _reduce(x)
    return exponent * LN2 + _log1p_reduced(f)


def reference_gumbel_scores(
    scores: torch.Tensor, ids: torch.Tensor | None, key: int
) -> torch.Tensor:
    """`scores + G` with torch operators (see the module docstring): the native kernel's
    result bit for bit, on any device.

    Args:
        scores: `[n]` float32 candidate scores (tempered logits or log-probabilities).
        ids: `[n]` int64 token ids of the candidates; None: candidate i is token i.
        key: the draw's key (`draw_key`), 0 <= key < 2**63.

    Returns:
        `[n]` float32 perturbed scores.
    """
    scores = scores.float()
    if ids is None:
        ids = torch.arange(scores.shape[-1], dtype=torch.int64, device=scores.device)
    hashed = _hash31(key, ids.to(torch.int64)).to(torch.int32)
    small = hashed < SMALL_HASH
    count = torch.where(small, hashed, (1 << 31) - 1 - hashed).to(torch.float32)
    point = (count + 0.5) * INV_2_31  # W (small) or V = 1 - W, in (0, 1)
    exponent, f = _reduce(point)
    exponent = torch.where(small, 0.0, exponent)
    f = torch.where(small, -point, f)
    exponential = -(exponent * LN2 + _log1p_reduced(f))  # E = -log(U) > 0
    return scores + -_log(exponential)


_native_kernel: list[GumbelKernel | None] = [None]


def use_native_gumbel_kernel(kernel: GumbelKernel | None) -> None:
    """Set by `quant.native_kernels` when exo's native library is wanted and loaded
    (`native_int4_kernel`; decoding/ sits below quant/ and does not import it): the
    kernel `gumbel_scores` calls from then on; None: torch's operators."""
    _native_kernel[0] = kernel


def native_gumbel_kernel() -> GumbelKernel | None:
    """`gumbel_scores(scores [n] float32, ids [n] int64 or None, key, width) -> [n] float32`
    of exo's native kernels (`width` 0: the widest built; 512, 256 or 1 force a path),
    once `use_native_gumbel_kernel` has handed it over; else None."""
    return _native_kernel[0]


def gumbel_scores(scores: torch.Tensor, ids: torch.Tensor | None, key: int) -> torch.Tensor:
    """`reference_gumbel_scores`, by the native kernel where the scores are on the CPU and
    it is built (the same bits)."""
    kernel = native_gumbel_kernel() if scores.device.type == "cpu" else None
    if kernel is None:
        return reference_gumbel_scores(scores, ids, key)
    ids = None if ids is None else ids.to(torch.int64).contiguous()
    return kernel(scores.float().contiguous(), ids, key, 0)


def race_winner(perturbed: torch.Tensor) -> int:
    """The index of the largest perturbed score `[n]` (the first of equal ones; a NaN counts
    as the largest, as in `torch.argmax`); numpy's argmax on the CPU (torch's is slower)."""
    if perturbed.device.type == "cpu" and perturbed.dtype == torch.float32:
        return int(np.argmax(perturbed.detach().numpy()))
    return int(torch.argmax(perturbed).item())


def race_index(scores: torch.Tensor, ids: torch.Tensor | None, key: int) -> int:
    """The index (into `scores`) the race with `key` picks: a draw of softmax(scores).

    Args:
        scores: `[n]` float scores (-inf: never picked unless every score is -inf).
        ids: `[n]` token ids (None: index i is token i).
        key: the draw's key.
    """
    return race_winner(gumbel_scores(scores, ids, key))


def race_probabilities(probs: torch.Tensor, key: int) -> int:
    """An index drawn with probabilities `probs` `[n]` (need not sum to 1; zeros are never
    drawn while any entry is positive): the race over their logs, keyed by index."""
    return race_index(torch.log(probs.double()).float(), None, key)
