"""The formats the engine holds weights in and rounds activations to, and the byte sizes
memory arithmetic counts them with.

`WeightFormat` (float32 / int8 / int4, int4 on CPU: `ENGINE_CPU_WEIGHT_FORMAT`), the int4
packed layout's group and block sizes, and the prefill / decode activation roundings
(`--prefill-activations`, `--decode-activations`). Apart from `memory` because the engine,
the node's options and placement all name these formats without sizing anything; the
sizes of a model's weights in each format are in `exo.shared.models.memory`.
"""

from __future__ import annotations

from typing import Literal

from exo.utils.cpu_features import AMX_BF16_FLAGS, cpu_flags

WeightFormat = Literal["float32", "int8", "int4"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("float32", "int8", "int4")
# How prefill rounds activations for exo's block weights (int4, 5-bit, GGUF's int8 blocks)
# on AVX2 CPUs (`--prefill-activations`): "int16" per block of 32 (the decode kernels'
# rounding, exact integer sums), "int8" per block of 32 (llama.cpp's; faster, less exact), or
# "bf16" (the weight dequantized to bfloat16 too, multiplied by AMX tiles: CPUs with
# AMX-BF16 only, elsewhere int16; native/prefill_bf16.cpp).
PrefillActivations = Literal["int16", "int8", "bf16"]
PREFILL_ACTIVATIONS: tuple[PrefillActivations, ...] = ("int16", "int8", "bf16")
# The engine's default (a node's is bf16 on AMX-BF16 CPUs, else this:
# `default_prefill_activations` below). Not int8: on SmolLM2-135M (int4)
# int8 prefill turns the greedy answer to "What is the capital of France?" from "The
# capital of France is Paris." into "L'Étoile, la Marseillaise, la femme, ..." (llama.cpp
# on the same Q4_1 GGUF answers that same text word for word); rounding the prompt's last
# row to int16 does not bring Paris back.
DEFAULT_PREFILL_ACTIVATIONS: PrefillActivations = "int16"
# How int4 weights' decode products round activations (`--decode-activations`): "int16" per
# block of 32 (the default: below float16's precision), or "int8" per block of 32
# (llama.cpp's precision, native/int4_decode_int8.cpp: 1.2-1.6x the int4 decode products on
# AVX2 CPUs without VNNI, for the KL docs/engine.md's "Decode activations" gives). With
# int8, every row of an int4 product takes int8, prompt rows too, so a stream's tokens do
# not depend on which kernel its step's row count picks.
DecodeActivations = Literal["int16", "int8"]
DECODE_ACTIVATIONS: tuple[DecodeActivations, ...] = ("int16", "int8")
DEFAULT_DECODE_ACTIVATIONS: DecodeActivations = "int16"
ENGINE_CPU_WEIGHT_FORMAT: WeightFormat = "int4"


def default_prefill_activations(flags: frozenset[str] | None = None) -> PrefillActivations:
    """`--prefill-activations`' default on a CPU with `flags` (default: this one's): "bf16"
    where AMX-BF16 runs prefill (`AMX_BF16_FLAGS`), else "int16". bf16 multiplied Gemma 3
    270M's and SmolLM2-135M's 128-512-row int4 products ~2x as fast as int16 on a 2-core
    Xeon with AMX, for a KL of ~2e-4 from int16's next-token distributions (docs/engine.md,
    "Prefill activations")."""
    return "bf16" if (cpu_flags() if flags is None else flags) >= AMX_BF16_FLAGS else "int16"


INT4_GROUP_SIZE = 32  # inputs sharing one (scale, zero) pair
INT4_BLOCK_OUTPUTS = 64  # output channels per block of the CPU int4 packed layout
FLOAT32_BYTES = 4
BFLOAT16_BYTES = 2
