"""Weight-only quantization of a loaded model's linear layers (CPU).

`quantize_linears` swaps every `nn.Linear` of the decoder layers and the LM head for a module
holding int8 (per output channel) or int4 (group-wise, asymmetric, as gpt-fast) weights. The
model's own code is untouched: the new modules have `nn.Linear`'s call signature.

Decode (a few rows per call) runs the fused kernels `aten._weight_int8pack_mm` and
`aten._weight_int4pack_mm_for_cpu` on bfloat16 activations: they read 1 or 1/2 byte per
weight instead of 4, and decode is memory-bandwidth bound. (The same kernels with float32
activations are several times slower than a float32 matmul, so activations are cast to
bfloat16 around each call.) Prefill (many rows) instead dequantizes the weight to bfloat16
for one oneDNN matmul, which is much faster than the row-by-row kernels there.

Measured on the 2-core reference machine (AVX512-BF16/AMX), SmolLM2-135M: see
bench/bench_engine.py and the engine's `weight_dtype` option.

On x86 CPUs with AVX2 + FMA (AVX512 ones included: torch's kernel is slower there too; see
`native_kernels`, figures: docs/benchmarks/engine-design-figures.md#native_kernelspy), int4
linears hold exo's layout and run exo's own kernel on float32 rows (`native_kernels`,
`Int4Linear._hold`); torch's kernels remain for other CPUs.
"""

from __future__ import annotations

from torch import nn

from exo.shared.models.weight_formats import PREFILL_ACTIVATIONS, PrefillActivations, WeightFormat
from exo.worker.engines.torch.comm.parallel_linears import AllReducedLinear, RowParallelLinear
from exo.worker.engines.torch.quant.int4_groups import Int4Linear, int4_supported
from exo.worker.engines.torch.quant.int8_channels import Int8Linear
from exo.worker.engines.torch.quant.quantized_linear import (
    QuantizedLinear,
)

# The formats the engine holds weights in; `exo.shared.models.memory` sizes each of them.
WeightDtype = WeightFormat
WEIGHT_DTYPES: tuple[WeightDtype, ...] = ("float32", "int8", "int4")


def quantize_output_layer(model: nn.Module, weight_dtype: WeightDtype) -> bool:
    """Put the model's LM head (its output embeddings) in int8 for any quantized
    `weight_dtype`: an int4 LM head flipped greedy answers of SmolLM2-135M (it no longer
    answered "Paris"), an int8 one did not. A tied head gets its own int8 copy; the input
    embedding stays float32 (one row is read per token; an int8 embedding on top of int4
    layers flipped answers too). (A head stored as GGUF Q8_0 / Q5_x blocks is held exactly
    instead: `gguf_weights.split_output_layer`.)

    Returns:
        whether a head was replaced (False for "float32" or a rank without the head).
    """
    if weight_dtype == "float32":
        return False
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    lm_head = get_output_embeddings() if callable(get_output_embeddings) else None
    if type(lm_head) is not nn.Linear:
        return False
    for name, module in model.named_modules():
        if module is lm_head:
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attribute, Int8Linear(lm_head))
            return True
    return False


def quantize_linears(model: nn.Module, weight_dtype: WeightDtype) -> int:
    """Replace the `nn.Linear` modules of `model` (a whole model, or one decoder layer as
    the loader does) in place.

    "int4" puts linears in int4 and a model's LM head in int8 (see
    `quantize_output_layer`); a linear whose shape int4 cannot pack also gets int8.

    Returns:
        the number of replaced modules.
    """
    if weight_dtype == "float32":
        return 0
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; expected one of {WEIGHT_DTYPES}")
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    lm_head = get_output_embeddings() if callable(get_output_embeddings) else None
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) in (nn.Linear, RowParallelLinear)
    ]
    for name, found in targets:
        # A tensor-parallel row slice is quantized like any linear, minus its bias, which
        # goes after the all-reduce; its int4 groups are the full weight's (K/world % 32 == 0).
        linear = found
        if type(found) is RowParallelLinear:
            linear = nn.Linear(found.in_features, found.out_features, bias=False)
            linear.weight = found.weight
        replacement: nn.Module
        if weight_dtype == "int4" and found is not lm_head and int4_supported(linear):
            replacement = Int4Linear(linear)
        else:
            replacement = Int8Linear(linear)
        if type(found) is RowParallelLinear:
            replacement = AllReducedLinear(replacement, found.bias)
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, replacement)
    return len(targets)


def set_prefill_activations(model: nn.Module, activations: PrefillActivations) -> int:
    """Round prefill's activations as `activations` says ("int16" or "int8" per block of 32,
    or "bf16") in every quantized linear of `model`; the number of linears set. On AVX2
    CPUs, with int8 the block weights whose integers fit change (int4, 5-bit, int8 values in
    [-32, 31] such as Q6_K's: native/prefill_int8.cpp), with bf16 every block weight where
    the CPU has AMX-BF16 (native/prefill_bf16.cpp; elsewhere int16); a step's decode rows
    keep int16 (`DECODE_ROWS`).

    Raises:
        ValueError: an unknown `activations`.
    """
    if activations not in PREFILL_ACTIVATIONS:
        raise ValueError(
            f"prefill activations must be one of {', '.join(PREFILL_ACTIVATIONS)}, "
            f"not {activations!r}"
        )
    count = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.prefill_activations = activations
            count += 1
    return count
