"""How GGUF files store a mixture-of-experts model's routed experts, as data per GGUF
architecture, and their reading into the engine's per-expert checkpoint names.

llama.cpp's converter (`convert_hf_to_gguf.py`) stacks each MoE layer's experts into one
3-D tensor per projection: `blk.N.ffn_gate_exps.weight`, `ffn_up_exps`, `ffn_down_exps`,
GGUF shape `[in, out, experts]` (fastest first), i.e. row-major `[experts, out, in]` with
each expert's `[out, in]` rows contiguous and every row whole quantized blocks. So one
expert's weight is a plain slice of the tensor's bytes, and it is repacked like a dense
weight (`gguf_repack`: Q4_0 / Q4_1 / Q4_K as int4 groups, other types as raw blocks, never
dequantized), stored under the name the engine's `RoutedExperts` loads
(`model.layers.N.mlp.experts.E.gate_proj.weight`), so an expert-parallel rank reads only its
experts' tensors, as from a Hugging Face checkpoint. The router (`ffn_gate_inp`) and the
attention are ordinary tensors, mapped by gguf-py's `TensorNameMap`.

A layout says which stacked tensors an architecture has, the per-expert name each becomes,
and which config fields come from which metadata keys (transformers' GGUF config reader
knows `expert_count` and `expert_used_count` but not an expert's width). Another MoE
architecture joins by adding its entry: shared experts (`ffn_*_shexp`, 2-D, mapped by
`TensorNameMap` once the family's skeleton has them), a routing bias (`exp_probs_b`) and
attention sinks (`attn_sinks`) are ordinary tensors too; only fused expert tensors
(`ffn_gate_up_exps`) would need a split along `out` (see `StackedExperts.tensors`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exo.download.gguf_tensors import GgufDirectory, GgufTensor

_STACKED = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<kind>[a-z_]+)\.weight$")


class GgufExpertsError(ValueError):
    """A MoE GGUF whose expert tensors or metadata the engine cannot read (named)."""


@dataclass(frozen=True, slots=True)
class StackedExperts:
    """One GGUF architecture's routed experts.

    Attributes:
        tensors: stacked tensor kind (`ffn_gate_exps`) → the per-expert checkpoint name in
            a decoder layer, `{expert}` standing for the expert id.
        config_fields: GGUF metadata key without the `<arch>.` prefix → the config field it
            sets (values transformers' GGUF reader leaves out).
        config_values: config fields with the value llama.cpp always uses for the
            architecture (the GGUF does not store them).
    """

    tensors: Mapping[str, str]
    config_fields: Mapping[str, str] = field(default_factory=dict)
    config_values: Mapping[str, Any] = field(default_factory=dict)


# llama.cpp's qwen3moe graph (`llm_build_qwen3moe`): every layer sparse, softmax top-k
# renormalized over the chosen experts (`norm_w = true`), SiLU-gated experts.
GGUF_EXPERT_LAYOUTS: dict[str, StackedExperts] = {
    "qwen3moe": StackedExperts(
        tensors={
            "ffn_gate_exps": "mlp.experts.{expert}.gate_proj.weight",
            "ffn_up_exps": "mlp.experts.{expert}.up_proj.weight",
            "ffn_down_exps": "mlp.experts.{expert}.down_proj.weight",
        },
        config_fields={"expert_feed_forward_length": "moe_intermediate_size"},
        config_values={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
}


def stacked_kind(tensor_name: str, layout: StackedExperts) -> tuple[int, str] | None:
    """(layer, kind) of a stacked expert tensor of `layout`, None for any other tensor."""
    match = _STACKED.match(tensor_name)
    if match is None or match.group("kind") not in layout.tensors:
        return None
    return int(match.group("layer")), match.group("kind")


def expert_slices(
    tensor: GgufTensor, layout: StackedExperts
) -> Iterator[tuple[str, np.ndarray, tuple[int, int]]]:
    """Each expert's part of a stacked tensor: (checkpoint name, its bytes, `[out, in]`).

    The bytes are a view of `tensor.data` (`[out, bytes per row]`, nothing copied).

    Raises:
        GgufExpertsError: not a 3-D tensor of `layout`'s kinds.
    """
    parsed = stacked_kind(tensor.name, layout)
    if parsed is None or len(tensor.shape) != 3:
        raise GgufExpertsError(f"{tensor.name} is no stacked expert tensor, shape {tensor.shape}")
    layer, kind = parsed
    columns, rows, experts = tensor.shape
    per_expert = tensor.data.reshape(experts, rows, -1)
    template = f"model.layers.{layer}.{layout.tensors[kind]}"
    for expert in range(experts):
        yield template.format(expert=expert), per_expert[expert], (rows, columns)


def check_experts(directory: GgufDirectory, layout: StackedExperts, config: Any) -> None:
    """Check every decoder layer has each stacked tensor with the config's shape
    (`[hidden, moe_intermediate_size, num_experts]` for gate / up, the first two swapped
    for down, GGUF order).

    Raises:
        GgufExpertsError: naming the missing or mis-shaped tensor.
    """
    hidden, width = int(config.hidden_size), int(config.moe_intermediate_size)
    experts = int(config.num_experts)
    by_name = {tensor.name: tensor for tensor in directory.tensors}
    for layer in range(int(config.num_hidden_layers)):
        for kind in layout.tensors:
            name = f"blk.{layer}.{kind}.weight"
            tensor = by_name.get(name)
            if tensor is None:
                raise GgufExpertsError(f"the GGUF has no {name} (every layer is sparse)")
            expected = (width, hidden) if "down" in kind else (hidden, width)
            if tensor.shape != (*expected, experts):
                raise GgufExpertsError(
                    f"{name} has shape {tensor.shape}, expected {(*expected, experts)} "
                    "(GGUF order: in, out, experts)"
                )


def configure_experts(config: Any, directory: GgufDirectory, layout: StackedExperts) -> None:
    """Set the config fields `layout` reads from the GGUF's metadata or fixes.

    Raises:
        GgufExpertsError: a metadata key the layout needs is missing.
    """
    architecture = directory.architecture
    for key, field_name in layout.config_fields.items():
        value = directory.metadata.get(f"{architecture}.{key}")
        if value is None:
            raise GgufExpertsError(f"the GGUF has no {architecture}.{key} in its metadata")
        setattr(config, field_name, value)
    for field_name, value in layout.config_values.items():
        setattr(config, field_name, value)


def gguf_moe_fields(directory: GgufDirectory) -> dict[str, Any]:
    """The MoE config fields of a GGUF (`num_experts`, `num_experts_per_tok`, the layout's
    own), as `exo.shared.models.moe.moe_geometry_of_config` reads them; empty for a dense
    architecture or a file without `<arch>.expert_count`."""
    layout = GGUF_EXPERT_LAYOUTS.get(directory.architecture)
    architecture = directory.architecture
    experts = directory.metadata.get(f"{architecture}.expert_count")
    if layout is None or not experts:
        return {}
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": directory.metadata.get(f"{architecture}.expert_used_count"),
        "num_hidden_layers": directory.metadata.get(f"{architecture}.block_count"),
    }
    for key, field_name in layout.config_fields.items():
        fields[field_name] = directory.metadata.get(f"{architecture}.{key}")
    fields.update(layout.config_values)
    return fields
