"""The pieces the lean forward (`model/direct_forward.py`) reads out of a loaded transformers model:
projections (fused Q/K/V and gate/up, quantized or dense, row-parallel with their
all-reduce), RMSNorm weights, the MLP's activation, and whether the CPU computes bfloat16
natively.

Nothing here runs transformers code per token: each piece holds the loaded module's tensors
(or the quantized module, whose kernel it calls directly) and does one or two torch ops.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exo.worker.engines.torch.comm.parallel_linears import AllReducedLinear, RowParallelLinear
from exo.worker.engines.torch.comm.tcp_mesh import all_reduce_sum
from exo.worker.engines.torch.model.fusion import FusedRMSNorm, fuse_linears
from exo.worker.engines.torch.quant.quantized_linear import QuantizedLinear

# "1" / "0": force bfloat16 activations on or off (default: on where the CPU has native
# bfloat16 arithmetic and the model's linears are quantized).
BF16_ENV = "EXO_LEAN_BF16"


class LeanUnsupportedError(ValueError):
    """The model has a part the lean forward has no code for (it then runs transformers')."""


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively: the x86 flags `avx512_bf16` /
    `amx_bf16` or the Arm flag `bf16` in /proc/cpuinfo. (`torch.backends.cpu.
    get_cpu_capability()` names only the vector ISA torch dispatches to, e.g. "AVX512",
    which does not imply bfloat16 instructions.) False where /proc/cpuinfo is unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def bf16_activations_wanted() -> bool:
    """`BF16_ENV` when set ("1" / "0"), else `cpu_has_native_bf16()`."""
    forced = os.environ.get(BF16_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return cpu_has_native_bf16()


class Projection:
    """One linear of a decoder layer (possibly several fused along outputs), called on
    `[T, in]` rows.

    Kinds: a dense float32 weight (`F.linear`); a quantized module whose kernel is called
    directly on bfloat16 rows (`bf16=True`: no cast around it) or through its own forward
    (float32 rows, cast around the kernel: the fallback without native bfloat16); exo's own
    int4 kernel (`native_kernels`, on AVX2 CPUs) on float32 rows with no cast at all; unfusable
    parts (mixed int4/int8) run one by one and are concatenated. A row-parallel linear's
    partial sum is all-reduced (in float32) before its bias.

    Output dtype: float32, except bfloat16 for torch's quantized kernels with `bf16=True`
    and no all-reduce.
    """

    __slots__ = (
        "bf16", "bias", "native", "out_features", "parts", "quantized", "reduce", "weight",
    )  # fmt: skip

    def __init__(self, modules: Sequence[nn.Module], bf16: bool) -> None:
        self.bf16 = bf16
        self.reduce = False
        self.weight: torch.Tensor | None = None
        self.quantized: QuantizedLinear | None = None
        self.native = False
        self.parts: list[Projection] = []
        self.bias: torch.Tensor | None = None
        self.out_features: int
        if len(modules) > 1:
            fused = fuse_linears(modules)
            if fused is None:  # mixed kinds: run each, concatenate
                self.parts = [Projection([module], bf16) for module in modules]
                self.out_features = sum(part.out_features for part in self.parts)
                return
            modules = [fused]
        module = modules[0]
        if isinstance(module, AllReducedLinear):
            self.reduce = True
            self.bias = module.bias
            module = module.local
        elif isinstance(module, RowParallelLinear):
            self.reduce = True
        if isinstance(module, QuantizedLinear):
            self.quantized = module
            # exo's int4 kernel (`native_kernels`) takes and gives float32 rows directly.
            self.native = bool(getattr(module, "native", False))
            if not self.reduce:
                bias = module.bias
                self.bias = None if bias is None else bias.to(self._kernel_out_dtype)
        elif isinstance(module, nn.Linear):
            self.weight = module.weight.detach()
            if module.bias is not None:
                self.bias = module.bias.detach()
        else:
            raise LeanUnsupportedError(f"no lean code for a {type(module).__name__} linear")
        self.out_features = int(module.out_features)

    @property
    def prefill_activations(self) -> str | None:
        """How prefill rounds this projection's activations (`QuantizedLinear.
        prefill_activations` of its first quantized part); None for dense weights."""
        if self.quantized is not None:
            return self.quantized.prefill_activations
        for part in self.parts:
            found = part.prefill_activations
            if found is not None:
                return found
        return None

    @property
    def _kernel_out_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 and not self.native else torch.float32

    @property
    def in_dtype(self) -> torch.dtype:
        """The dtype its rows must come in."""
        if self.parts:
            return self.parts[0].in_dtype
        if self.quantized is not None and self.bf16 and not self.native:
            return torch.bfloat16
        return torch.float32

    def decode_tensors(self) -> list[torch.Tensor | None] | None:
        """`[weight, scale_zero, bias]` as exo's decode layer (`native/decode_layer.cpp`)
        reads them: exo's int4 blocks (uint8 `[out, in / 2]`) or int8 blocks (int8 `[out,
        in]`) with their bfloat16 (scale, zero) pairs, symmetric int8 blocks (int8 `[out,
        in]`, bfloat16 scales `[out, in / 16 or 32]`), 5-bit lanes (uint8 `[out, ceil(in / 96)
        * 64]`, bfloat16 scales `[out, in / 32]`), symmetric int8 (int8 `[out, in]`)
        with its bfloat16 scale per output `[out]`, or a dense weight (float32, or bfloat16
        held unquantized) with None; bias
        float32 `[out]` or None (a row-parallel linear's bias, which the decode layer adds
        after the caller's all-reduce). None where that layer cannot run it: torch's int4
        layout, unfusable parts."""
        if self.parts:
            return None
        bias = None if self.bias is None else self.bias.float().contiguous()
        if self.weight is not None:
            return [self.weight.contiguous(), None, bias]
        if not self.native:
            return None
        module: Any = self.quantized
        packed = getattr(module, "packed", None)
        if packed is not None and packed.dtype == torch.uint8:  # Int4Linear, exo's layout
            return [packed, module.scales_and_zeros, bias]
        int5 = getattr(module, "int5_lanes", None)
        block_scales = getattr(module, "block_scales", None)
        if int5 is not None and block_scales is not None:  # Int5Linear's 5-bit lanes
            return [int5, block_scales, bias]
        values = getattr(module, "values", None)
        if values is not None and block_scales is not None:  # ScaledInt8Linear's blocks
            return [values, block_scales, bias]
        if values is not None and values.dtype == torch.int8:  # SplitInt4Linear's blocks
            return [values, module.scale_zero, bias]
        scales = getattr(module, "scales", None)
        if isinstance(scales, torch.Tensor) and scales.dim() == 1:  # Int8Linear's channels
            return [module.weight, scales, bias]
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16:  # Bf16Linear
            return [weight, None, bias]
        return None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if self.parts:
            return torch.cat([part(rows.to(part.in_dtype)) for part in self.parts], dim=-1)
        if self.weight is not None:
            out = F.linear(rows, self.weight, None if self.reduce else self.bias)
        else:
            assert self.quantized is not None
            if self.bf16 or self.native:
                out = self.quantized.matmul(rows)
            else:
                out = self.quantized.matmul(rows.to(torch.bfloat16)).float()
            if not self.reduce and self.bias is not None:
                out = out + self.bias
        if self.reduce:
            out = out.float()
            all_reduce_sum(out)
            if self.bias is not None:
                out = out + self.bias
        return out


def norm_weight(module: nn.Module, offset: float) -> tuple[torch.Tensor, float]:
    """An RMSNorm's `offset + weight` (float32) and epsilon, for `F.rms_norm`.

    Raises:
        LeanUnsupportedError: the module has no weight or epsilon where RMSNorms keep them.
    """
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(eps, float):
        raise LeanUnsupportedError(
            f"{type(module).__name__} is not an RMSNorm the lean forward reads"
        )
    weight = weight.detach().float()
    if offset:
        weight = weight + offset
    return weight, eps


def is_rms_norm(module: nn.Module) -> bool:
    return isinstance(module, FusedRMSNorm) or "RMSNorm" in type(module).__name__


Activation = Callable[[torch.Tensor], torch.Tensor]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def activation_code(activation: Activation) -> int:
    """The activation's number in exo's decode layer (`native/decode_layer.cpp`): 0 SiLU,
    1 tanh-GELU, 2 exact GELU."""
    return {F.silu: 0, _gelu_tanh: 1, F.gelu: 2}[activation]


def mlp_activation(mlp: nn.Module) -> Activation:
    """The gated MLP's activation as a torch function, identified by evaluating the
    module's own (`act_fn`, or Phi-3's `activation_fn`) on fixed points: SiLU (Llama,
    Qwen, Mistral, Phi-3), tanh-GELU (Gemma), exact GELU.

    Raises:
        LeanUnsupportedError: none matches.
    """
    module = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    if not callable(module):
        raise LeanUnsupportedError(f"{type(mlp).__name__} has no act_fn")
    probe = torch.linspace(-6.0, 6.0, 97)
    with torch.no_grad():
        reference = module(probe)
    candidates: tuple[Activation, ...] = (F.silu, _gelu_tanh, F.gelu)
    for candidate in candidates:
        if torch.allclose(reference, candidate(probe), rtol=0.0, atol=1e-6):
            return candidate
    raise LeanUnsupportedError(f"unknown activation {type(module).__name__}")


def rotary_tables(
    cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary position embedding as one gather and two products over whole heads.

    transformers applies `x * cos + rotate_half(x) * sin` to the first `rotary_dim` values
    of each head (`rotate_half(x) = cat(-x2, x1)`; the rest pass unchanged: Phi-4-mini's
    partial rotary). Here `x * cos_full + x[..., perm] * sin_full` gives the same products
    with the sign folded into `sin_full` and 1 / 0 over the pass-through values.

    Args:
        cos / sin: `[T, rotary_dim]` from the model's rotary module.

    Returns:
        `cos_full` `[T, 1, head_dim]`, `sin_full` `[T, 1, head_dim]`, `perm` `[head_dim]`.
    """
    rows, rotary = cos.shape
    half = rotary // 2
    cos_full = cos.new_ones(rows, head_dim)
    sin_full = sin.new_zeros(rows, head_dim)
    cos_full[:, :rotary] = cos
    sin_full[:, :half] = -sin[:, :half]
    sin_full[:, half:rotary] = sin[:, half:]
    perm = torch.arange(head_dim, device=cos.device)
    perm[:half] += half
    perm[half:rotary] -= half
    return cos_full[:, None], sin_full[:, None], perm


def multimodal_rotary_tables(
    tables: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    sections: Sequence[int],
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One whole-head rotary table (`direct_forward_parts.rotary_tables`) for multimodal
    positions, from the tables of each of the three position rows (temporal, height,
    width), in both halves of the head alike:
    - in sections (Qwen2.5-VL, transformers' `Qwen2_5_VLRotaryEmbedding`): a head's
      frequencies are cut into `sections` (`mrope_section`, summing to half the rotary
      width) and the i-th section's values come from row `i % 3`'s table;
    - interleaved (Qwen3-VL, transformers' `Qwen3VLTextRotaryEmbedding`): frequency `f`
      comes from the height row where `f % 3 == 1` and `f < 3 x sections[1]`, from the
      width row where `f % 3 == 2` and `f < 3 x sections[2]`, else from the temporal row.
    Values past the rotary width (none for either) are the temporal table's.

    Args:
        tables: three `(cos [T, 1, head_dim], sin [T, 1, head_dim], perm [head_dim])`.
        sections: frequencies per position row.
        interleaved: Qwen3-VL's layout instead of sections.

    Returns:
        `(cos, sin, perm)` as one of `tables`.

    Raises:
        ValueError: not three tables, or sections wider than half a head.
    """
    if len(tables) != 3:
        raise ValueError(f"multimodal rotary takes three position rows, got {len(tables)}")
    half = sum(sections)
    head_dim = tables[0][0].shape[-1]
    if 2 * half > head_dim:
        raise ValueError(f"mrope sections {list(sections)} are wider than half a {head_dim} head")
    source = torch.zeros(head_dim, dtype=torch.long)
    if interleaved:
        for row in (1, 2):
            source[row : min(3 * sections[row], half) : 3] = row
        source[half : 2 * half] = source[:half]
    else:
        first = 0
        for index, width in enumerate(sections):
            source[first : first + width] = index % 3
            source[half + first : half + first + width] = index % 3
            first += width
    source = source.to(tables[0][0].device)
    cos = torch.stack([table[0] for table in tables])  # [3, T, 1, head_dim]
    sin = torch.stack([table[1] for table in tables])
    pick = source.view(1, 1, 1, head_dim).expand(1, *cos.shape[1:])
    return cos.gather(0, pick)[0], sin.gather(0, pick)[0], tables[0][2]


RotaryTables = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# Positions per block of cached rotary tables, and the widest span of positions kept.
ROTARY_BLOCK = 256
ROTARY_CACHE_LIMIT = 8192


def static_rope(rotary: nn.Module, kinds: Sequence[str | None]) -> bool:
    """Whether `rotary` (a transformers rotary module) gives every position the same
    cos / sin whatever else the step holds: true for every rope type but transformers'
    "dynamic" ones (NTK scaling that changes with the longest position) and "longrope"
    (short or long factors by the same), which `dynamic_rope_update` recomputes per call.
    False where the module does not say its type."""
    types: Any = getattr(rotary, "rope_type", None)
    if isinstance(types, dict):
        named = [types.get(kind) for kind in kinds]
    else:
        named = [types for _ in kinds]
    return all(
        isinstance(name, str) and "dynamic" not in name and name != "longrope" for name in named
    )


class RotaryCache:
    """Whole-head rotary tables for a span of positions, computed once and gathered per step.

    `compute(positions [P] int64, dtype, device)` gives each rope kind's tables for
    `positions` (`LeanModel._computed_rotary_tables`); the cache asks it for whole blocks of
    `ROTARY_BLOCK` positions covering a step's positions and keeps them until a step falls
    outside (a decode step moves past the span once per block). A step whose positions span
    more than `ROTARY_CACHE_LIMIT` is computed directly and not kept (a long prefill next to
    a short decode would otherwise keep its tables: 2 KiB per position per kind for a head
    of 256).
    """

    def __init__(
        self, compute: Callable[[torch.Tensor, torch.dtype, torch.device], RotaryTables]
    ) -> None:
        self._compute = compute
        self._first = 0
        self._end = 0
        self._key: tuple[torch.dtype, torch.device] | None = None
        self._tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def tables(
        self, position_ids: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> RotaryTables:
        """Each kind's `cos` / `sin` `[T, 1, head_dim]` and `perm` `[head_dim]` for
        `position_ids` `[T]` (int64, >= 0)."""
        if position_ids.numel() == 0:
            return self._compute(position_ids, dtype, device)
        low, high = int(position_ids.min()), int(position_ids.max())
        if (dtype, device) != self._key or low < self._first or high >= self._end:
            first = low // ROTARY_BLOCK * ROTARY_BLOCK
            end = (high // ROTARY_BLOCK + 1) * ROTARY_BLOCK
            if end - first > ROTARY_CACHE_LIMIT:
                return self._compute(position_ids, dtype, device)
            span = torch.arange(first, end, dtype=torch.int64, device=device)
            computed = self._compute(span, dtype, device)
            self._tables = [(cos[:, 0], sin[:, 0], perm) for cos, sin, perm in computed]
            self._first, self._end, self._key = first, end, (dtype, device)
        rows = position_ids - self._first if self._first else position_ids
        return [
            (cos.index_select(0, rows)[:, None], sin.index_select(0, rows)[:, None], perm)
            for cos, sin, perm in self._tables
        ]
