"""exo's own CPU kernels (`native/*.cpp`) for x86 CPUs with AVX2 + FMA: decode products
for int4 blocks (`int4_gemv.cpp`), int8 per channel (`int8_channel.cpp`) and bfloat16
weights (`bf16_product.cpp`), int8 blocks with (scale, zero) pairs or symmetric scales per
16 or 32 inputs (`int8_blocks.cpp`), GGUF Q5_0's 5-bit blocks (`int5_blocks.cpp`), MXFP4
blocks read inside the product (`mxfp4.cpp`), GGUF Q6_K blocks as the file stores them (an
LM head's: `q6k_blocks.cpp`), the sampler's Gumbel-max race
(`gumbel_race.cpp`), prefill products (`prefill.cpp`), prefill's
gated activation and q/k norm + rotary (`prefill_ops.cpp`), a one-pass RMSNorm, and a
whole decoder layer's decode step (`decode_layer.cpp`, called by `direct_forward.LeanModel`
for decode steps, a short prompt chunk beside the decode rows included) and a MoE block's
int4 routed experts in one call (`moe_experts.cpp`; MXFP4 ones: `moe_mxfp4_experts.cpp`).

torch's `aten._weight_int4pack_mm_for_cpu` is fast where torch dispatches to AVX512 (its
tiled kernel reads the packed weights at memory speed) but on AVX2-only CPUs (AMD Zen 1-3,
most Intel desktop parts) it takes a compute-bound path, and where it dispatches to AVX512
it decodes slower than exo's kernels too, so exo's kernels run on every x86 CPU with AVX2 +
FMA. exo's kernel holds int4 blocks of 32 (pairs of blocks as 16-bit lanes of four nibbles),
takes float32 activations (no cast to bfloat16 around each call), rounds them to int16 per
block, sums the products in int32 with AVX2 and prefetches each weight row 16 KiB ahead (see
the C++ file): it reads the weights near memory speed and stays closer to the float32 model
than torch's int4 kernel on bfloat16 activations. torch's RMSNorm runs as ~7 operators on
CPU; exo's takes one pass. (figures: docs/benchmarks/engine-design-figures.md#native_kernelspy)

The C++ files are compiled on first use (torch's extension builder: the machine's C++
compiler and `ninja`, a dependency) into a cache directory (`TORCH_EXTENSIONS_DIR`, else
`~/.cache/torch_extensions`), under a name that carries the source's and flags' hash and
the instruction set it was built for, so a later start (or another runner) loads the built
library in well under a second. Where it cannot be built (no compiler), the engine logs why
once and keeps torch's kernels.

`NATIVE_INT4_ENV`: "1" uses the kernels on any CPU (the AVX2 path on x86 CPUs with AVX2 +
FMA, a portable exact float32 loop elsewhere; for tests and A/B runs), "0" never; unset:
where the CPU has AVX2 + FMA (AVX512 CPUs included)."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from loguru import logger

from exo.shared.models.weight_formats import DecodeActivations
from exo.utils.cpu_features import AMX_BF16_FLAGS, cpu_flags
from exo.worker.engines.torch.decoding.gumbel_race import use_native_gumbel_kernel
from exo.worker.engines.torch.quant.native_build import BuildStalled, built_extension

NATIVE_INT4_ENV = "EXO_NATIVE_INT4"

_NATIVE = Path(__file__).with_name("native")
_SOURCES = tuple(
    _NATIVE / name
    for name in (
        "int4_gemv.cpp",
        "int4_decode_int8.cpp",
        "int8_channel.cpp",
        "bf16_product.cpp",
        "int8_blocks.cpp",
        "int5_blocks.cpp",
        "mxfp4.cpp",
        "decode_layer.cpp",
        "decode_attention.cpp",
        "prefill.cpp",
        "prefill_int8.cpp",
        "prefill_dequantized.cpp",
        "prefill_bf16.cpp",
        "prefill_ops.cpp",
        "moe_experts.cpp",
        "moe_mxfp4_experts.cpp",
        "q4k_scales.cpp",
        "q6k_blocks.cpp",
        "gumbel_race.cpp",
    )
)
_HEADERS = (
    _NATIVE / "kernels.h",
    _NATIVE / "block_rows.h",
    _NATIVE / "row_ops.h",
    _NATIVE / "prefill_pack.h",
    _NATIVE / "int8_tile.h",
    _NATIVE / "int4_lanes.h",
    _NATIVE / "attention_vectors.h",
    _NATIVE / "moe_parallel.h",
)
Int4Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _x86_avx2() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= cpu_flags()


# Whether the kernel built here rounds activations to int16 blocks (its AVX2 path) or
# computes the float32 product exactly (its portable loop).
ROUNDS_ACTIVATIONS = _x86_avx2()


def rounded_activations(rows: torch.Tensor) -> torch.Tensor:
    """float32 rows `[n, in]` as the AVX2 kernel rounds them: per block of 32 inputs, the
    nearest integer multiple (ties to even, |multiple| <= 32767) of the block's scale, its
    largest |x| / 32767 (an all-zero block stays zero). Same float32 operations as the C++."""
    blocks = rows.reshape(rows.shape[0], -1, 32)
    scales = blocks.abs().amax(dim=-1, keepdim=True) / 32767.0
    values = torch.where(scales > 0, blocks / scales, 0.0).round_()
    return (values * scales).reshape(rows.shape)


def set_decode_activations(activations: DecodeActivations) -> None:
    """Round int4 products' activations as `activations` says from now on, in this process
    (exo's kernels' `set_decode_activation_bits`: one setting per process, which a runner's
    one engine sets at load; `weight_formats.DecodeActivations`). "int16" is a no-op where exo's
    kernels are not built; "int8" there raises RuntimeError (it would silently not apply)."""
    kernel = native_int4_kernel()  # also hands the sampler its native race kernel
    if kernel is None:
        if activations == "int8":
            raise RuntimeError(
                "--decode-activations int8 needs exo's native kernels (an x86 CPU with "
                "AVX2 + FMA), which are not available here"
            )
        return
    torch.ops.exo_native.set_decode_activation_bits(8 if activations == "int8" else 16)


def native_int4_wanted() -> bool:
    """Whether int4 linears should hold exo's layout and run its kernel (`NATIVE_INT4_ENV`,
    else: an x86 CPU with AVX2 + FMA). Building may still fail:
    `native_int4_kernel()` then returns None."""
    forced = os.environ.get(NATIVE_INT4_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return _x86_avx2()


def native_int4_kernel() -> Int4Gemv | None:
    """The compiled `int4_gemv(x [rows, in] float32, qweight [out, in / 2] uint8,
    scale_zero [out, groups, 2] bfloat16) -> [rows, out] float32` where it is wanted
    (`native_int4_wanted`) and could be built; else None (a failed build logs one warning
    naming the cause)."""
    kernel = built_int4_kernel() if native_int4_wanted() else None
    # The sampler's race kernel (decoding/ is below quant/: it is handed over from here).
    use_native_gumbel_kernel(None if kernel is None else torch.ops.exo_native.gumbel_scores)
    return kernel


@functools.cache
def built_int4_kernel() -> Int4Gemv | None:
    """The kernel of `native_int4_kernel`, built (or loaded from the cache) once per
    process whether or not it is wanted; None where that fails."""
    try:
        library = _built_library_for_this_cpu()
        torch.ops.load_library(str(library))
        kernel: Int4Gemv = torch.ops.exo_native.int4_gemv
    except Exception as error:  # a missing compiler or ninja, a failed build, a bad cache
        lines = str(error).strip().splitlines()
        logger.warning(
            "exo's native kernels could not be built ({}: {}); int4 layers use torch's kernel",
            type(error).__name__, lines[-1] if lines else "",
        )  # fmt: skip
        return None
    logger.debug("exo's native kernels loaded from {}", library)
    return kernel


def int16_prefill_is_integer() -> bool:
    """Whether prefill's products with int16 activations (`block_matmul`) take exo's integer
    GEMM, exactly the decode kernels' sums (AVX2 builds, and AVX512 ones with VNNI and BW),
    rather than the weight dequantized to float32 (the same product to float32 rounding:
    builds with AVX512 but not VNNI + BW, where that is faster, and `EXO_NATIVE_INT_GEMM=0`;
    see native/prefill.cpp). False where the kernels are not built."""
    if built_int4_kernel() is None:
        return False
    return bool(torch.ops.exo_native.int16_integer_gemm())


def bf16_prefill_available() -> bool:
    """Whether prefill's bf16 product runs here (`--prefill-activations bf16`: exo's kernels
    built with AMX-BF16, and oneDNN's AMX micro-kernel usable: native/prefill_bf16.cpp);
    elsewhere bf16 falls back to int16."""
    if native_int4_kernel() is None:  # not wanted here, or not built: nothing is built now
        return False
    return bool(torch.ops.exo_native.bf16_prefill_available())


def built_int8_block_kernel() -> Int4Gemv | None:
    """`int8_block_gemv(x [rows, in] float32, values [out, in] int8, scale_zero [out,
    in / 32, 2] bfloat16) -> [rows, out] float32`, `w = (v - 8) * scale + zero` per block of
    32 (GGUF's 8- and 5-bit blocks), from the same library as `built_int4_kernel`; None
    where that could not be built."""
    if built_int4_kernel() is None:
        return None
    kernel: Int4Gemv = torch.ops.exo_native.int8_block_gemv
    return kernel


def built_int8_scaled_kernel() -> Int4Gemv | None:
    """`int8_scaled_gemv(x [rows, in] float32, values [out, in] int8, scales [out, in / S]
    bfloat16) -> [rows, out] float32`, `w = v * scale` per block of S = 16 or 32 inputs
    (GGUF Q6_K, Q8_0), from the same library as `built_int4_kernel`; None where that could
    not be built."""
    if built_int4_kernel() is None:
        return None
    kernel: Int4Gemv = torch.ops.exo_native.int8_scaled_gemv
    return kernel


def _base_flags() -> list[str]:
    # OpenMP: torch's `at::parallel_for` is inlined into the extension and only spreads
    # work over the intra-op threads when the extension is compiled with it.
    flags = ["-O3", "-fopenmp"]
    if _x86_avx2():
        flags += ["-mavx2", "-mfma"]
        if "f16c" in cpu_flags():  # every AVX2 CPU: fp16 to float32 in one instruction
            flags += ["-mf16c"]
    return flags


def _flags() -> list[str]:
    flags = _base_flags()
    if _x86_avx2():
        # AVX512 and VNNI (one vpdpwssd / vpdpbusd per product and sum in the integer GEMMs;
        # with AVX512BW too, prefill.cpp's int16 tiles are 512 bits wide, without it int16
        # activations are multiplied in float32): GCC's own code stays 256 bits wide.
        cpu = cpu_flags()
        if "avx512f" in cpu:
            flags += ["-mavx512f", "-mprefer-vector-width=256"]
            if "avx512dq" in cpu:  # gumbel_race.cpp: one 64-bit multiply, not three 32-bit
                flags += ["-mavx512dq"]
            if {"avx512_vnni", "avx512vl"} <= cpu:
                flags += ["-mavx512vnni", "-mavx512vl"]
                if "avx512bw" in cpu:
                    flags += ["-mavx512bw"]
            if cpu >= AMX_BF16_FLAGS:
                # prefill_bf16.cpp: the weight dequantized to bfloat16 for oneDNN's AMX
                # micro-kernel (torch's), which runs the tiles.
                flags += ["-mavx512bf16", "-mavx512vl", "-DEXO_AMX_BF16"]
        elif "avx_vnni" in cpu:
            flags += ["-mavxvnni"]
    return flags


def _built_library_for_this_cpu() -> Path:
    """`_built_library` with this CPU's flags (`_flags`) or, where that build fails (a
    compiler too old for `-mavxvnni`, say: GCC 10), with the AVX2 ones (`_base_flags`).

    Raises:
        RuntimeError: the last build failed.
    """
    flags, base = _flags(), _base_flags()
    if flags == base:
        return _built_library(base)
    try:
        return _built_library(flags)
    except BuildStalled:
        raise  # a busy machine, not a flag the compiler refuses: the AVX2 build would stall too
    except Exception as error:  # the build's own failure
        lines = str(error).strip().splitlines()
        logger.warning(
            "exo's native kernels did not build with {} ({}); building them for AVX2 only",
            " ".join(flags[len(base) :]), lines[-1] if lines else type(error).__name__,
        )  # fmt: skip
        return _built_library(base)


def _built_library(flags: list[str]) -> Path:
    """The shared library for this source and these flags, built once per cache (in a child
    process, watched for stalls, resumable, under a lock: `native_build`).

    Raises:
        RuntimeError: the build failed or stalled (`native_build.BuildStalled`).
    """
    source = b"".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:12]
    name = f"exo_native_{'avx2' if _x86_avx2() else 'generic'}_{digest}"
    return built_extension(name, _SOURCES, flags, _cache_root())


def _cache_root() -> Path:
    """Where built kernels are kept: `TORCH_EXTENSIONS_DIR`, else
    `~/.cache/torch_extensions`, else (a home that is not writable) the temporary
    directory."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    candidates = [Path(configured)] if configured else []
    candidates += [
        Path.home() / ".cache" / "torch_extensions",
        Path(tempfile.gettempdir()) / f"torch_extensions-{os.getuid()}",
    ]
    for candidate in candidates:
        try:
            candidate.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(candidate, os.W_OK):
            return candidate
    raise RuntimeError("no writable directory for built kernels")
