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
`TensorNameMap` once the family's skeleton has them), a routing bias (`exp_probs_b.bias`,
the converter's rename of `e_score_correction_bias`) and attention sinks (`attn_sinks`) are
ordinary tensors too, checked with the experts where the layout has them
(`expected_expert_tensors`).

DeepSeek-V3-style files (`deepseek2`: DeepSeek-V3 / V3.1 / R1, Kimi-K2; `glm4moe`: GLM-4.5
to 4.7) stack the same three kinds in their sparse layers only, the layers from
`leading_dense_block_count` on, beside shared experts and the correction bias; their
configs come from the metadata (`gguf_configs`), a deepseek2 file's split MLA
up-projection is joined back (`gguf_mla`), and GLM's MTP layers (after the decoder
layers) are left out.

gpt-oss (`gpt-oss`, llama.cpp's `GptOssModel` converter) stacks the same three kinds, the
checkpoint's interleaved `gate_up_proj` already split into gate and up, each with a stacked
bias `blk.N.ffn_*_exps.bias` (GGUF shape `[out, experts]`) cut the same way; its expert
weights are GGML type MXFP4, repacked into exo's MXFP4 layout (`gguf_gptoss.repack_mxfp4`).
Ollama's first gpt-oss blobs (`gptoss`) keep gate and up in one tensor, rows interleaved
(`StackedExperts.interleaved`), cut into the two linears per expert.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exo.download.gguf_tensors import GgufDirectory, GgufTensor
from exo.shared.models.memory import GGUF_MXFP4_TYPES

_STACKED = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<kind>[a-z_]+)\.(?P<part>weight|bias)$")


class GgufExpertsError(ValueError):
    """A MoE GGUF whose expert tensors or metadata the engine cannot read (named)."""


@dataclass(frozen=True, slots=True)
class StackedExperts:
    """One GGUF architecture's routed experts.

    Attributes:
        tensors: stacked tensor kind (`ffn_gate_exps`) → the per-expert linear's path in
            a decoder layer (`.weight` / `.bias` appended), `{expert}` standing for the
            expert id.
        config_fields: GGUF metadata key without the `<arch>.` prefix → the config field it
            sets (values transformers' GGUF reader leaves out).
        config_values: config fields with the value llama.cpp always uses for the
            architecture (the GGUF does not store them).
        width_field / count_field: the config fields of an expert's width and of the
            number of experts.
        biases: each stacked weight has a stacked `.bias` `[out, experts]` (gpt-oss).
        interleaved: a kind whose rows alternate two linears (gate at even, up at odd) →
            those linears, filling `{linear}` in its path (Ollama's first gpt-oss blobs'
            `ffn_gate_up_exps`); its rows are twice the expert width.
        first_sparse_field: the config field of the dense layers before the first sparse
            one (None: every layer is sparse).
        shared_field: the config field of the shared experts' count, each as wide as a
            routed one (`ffn_{gate,up,down}_shexp`; None: none).
        correction_bias: each sparse layer has `exp_probs_b.bias` `[experts]`.
    """

    tensors: Mapping[str, str]
    config_fields: Mapping[str, str] = field(default_factory=dict)
    config_values: Mapping[str, Any] = field(default_factory=dict)
    width_field: str = "moe_intermediate_size"
    count_field: str = "num_experts"
    biases: bool = False
    interleaved: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    first_sparse_field: str | None = None
    shared_field: str | None = None
    correction_bias: bool = False


# The stacked gate / up / down experts of llama.cpp's converter (`ffn_*_exps`), each the
# checkpoint's `experts.N.{gate,up,down}_proj`: every architecture here but Ollama's first
# gpt-oss blobs.
_GATE_UP_DOWN = {
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}
# DeepSeek-V3-style sparse layers (llama.cpp's `llm_build_deepseek2`, `llm_build_glm4_moe`):
# the first `leading_dense_block_count` layers dense, every later one sigmoid-routed with a
# correction bias (`exp_probs_b.bias`) beside shared experts (`ffn_*_shexp`, 2-D, mapped by
# name); the config is built from the metadata (`gguf_configs`).
_DEEPSEEK_STYLE = StackedExperts(
    tensors=_GATE_UP_DOWN,
    count_field="n_routed_experts",
    first_sparse_field="first_k_dense_replace",
    shared_field="n_shared_experts",
    correction_bias=True,
)

# llama.cpp's qwen3moe graph (`llm_build_qwen3moe`): every layer sparse, softmax top-k
# renormalized over the chosen experts (`norm_w = true`), SiLU-gated experts.
GGUF_EXPERT_LAYOUTS: dict[str, StackedExperts] = {
    "qwen3moe": StackedExperts(
        tensors=_GATE_UP_DOWN,
        config_fields={"expert_feed_forward_length": "moe_intermediate_size"},
        config_values={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    # llama.cpp's gpt-oss graph (`llm_build_openai_moe_iswa`): every layer sparse, softmax
    # over the top-k router logits (router bias `ffn_gate_inp.bias`), biased experts; its
    # config is built by `gguf_gptoss.gptoss_config` (transformers' reader fails on it).
    "gpt-oss": StackedExperts(
        tensors=_GATE_UP_DOWN,
        config_fields={"expert_feed_forward_length": "intermediate_size"},
        width_field="intermediate_size",
        count_field="num_local_experts",
        biases=True,
    ),
    # Ollama's first gpt-oss blobs (its converter at fa7776f, from OpenAI's original
    # checkpoint): gate and up in one tensor, rows interleaved as in that checkpoint; no
    # `expert_feed_forward_length` key. `gguf_gptoss` reads the rest.
    "gptoss": StackedExperts(
        tensors={
            "ffn_gate_up_exps": "mlp.experts.{expert}.{linear}",
            "ffn_down_exps": "mlp.experts.{expert}.down_proj",
        },
        config_fields={"feed_forward_length": "intermediate_size"},
        width_field="intermediate_size",
        count_field="num_local_experts",
        biases=True,
        interleaved={"ffn_gate_up_exps": ("gate_proj", "up_proj")},
    ),
    # DeepSeek-V3 / V3.1 / R1, Kimi-K2 (`gguf_configs`, MLA: `gguf_mla`).
    "deepseek2": _DEEPSEEK_STYLE,
    # GLM-4.5 / 4.6 / 4.7 (`gguf_configs`); its MTP layers are left out.
    "glm4moe": _DEEPSEEK_STYLE,
}


def stacked_kind(tensor_name: str, layout: StackedExperts) -> tuple[int, str] | None:
    """(layer, kind) of a stacked expert weight (or, where `layout.biases`, bias) of
    `layout`, None for any other tensor."""
    match = _STACKED.match(tensor_name)
    if match is None or match.group("kind") not in layout.tensors:
        return None
    if match.group("part") == "bias" and not layout.biases:
        return None
    return int(match.group("layer")), match.group("kind")


def expert_slices(
    tensor: GgufTensor, layout: StackedExperts
) -> Iterator[tuple[str, np.ndarray, tuple[int, ...]]]:
    """Each expert's part of a stacked tensor: (checkpoint name, its bytes, its shape:
    `[out, in]` for a weight, `[out]` for a bias).

    The bytes are a view of `tensor.data` (`[out, bytes per row]` or `[bytes]`, nothing
    copied).

    Raises:
        GgufExpertsError: not a 3-D weight (2-D bias) of `layout`'s kinds.
    """
    parsed = stacked_kind(tensor.name, layout)
    bias = tensor.name.endswith(".bias")
    if parsed is None or len(tensor.shape) != (2 if bias else 3):
        raise GgufExpertsError(f"{tensor.name} is no stacked expert tensor, shape {tensor.shape}")
    layer, kind = parsed
    template = f"model.layers.{layer}.{layout.tensors[kind]}.{'bias' if bias else 'weight'}"
    rows, experts = tensor.shape[-2:] if not bias else tensor.shape
    linears = layout.interleaved.get(kind, ("",))
    step = len(linears)  # 2: the linears' rows alternate
    # [experts, rows, bytes per row] (a bias: bytes per element)
    per_expert = tensor.data.reshape(experts, rows, -1)
    for expert in range(experts):
        for start, linear in enumerate(linears):
            name = template.format(expert=expert, linear=linear)
            part = per_expert[expert, start::step]
            if bias:
                yield name, np.ascontiguousarray(part).reshape(-1), (rows // step,)
            else:
                yield name, part, (rows // step, tensor.shape[0])


def expected_expert_tensors(layout: StackedExperts, config: Any) -> dict[str, tuple[int, ...]]:
    """GGUF name → GGUF shape of every tensor the sparse layers must have: each stacked
    kind (`[hidden, width, experts]` for gate / up, the first two swapped for down; width
    and experts the layout's `width_field` / `count_field`), its `.bias` `[out, experts]`
    where the layout has biases, the router `ffn_gate_inp` `[hidden, experts]`, and where
    the layout has them the correction bias `exp_probs_b.bias` `[experts]` and the shared
    experts `ffn_*_shexp` (`shared_field` experts wide)."""
    hidden, width = int(config.hidden_size), int(getattr(config, layout.width_field))
    experts = int(getattr(config, layout.count_field))
    first = int(getattr(config, layout.first_sparse_field) or 0) if layout.first_sparse_field else 0
    shared = int(getattr(config, layout.shared_field) or 0) * width if layout.shared_field else 0
    expected: dict[str, tuple[int, ...]] = {}
    for layer in range(first, int(config.num_hidden_layers)):
        block = f"blk.{layer}."
        for kind in layout.tensors:
            rows = width * (2 if kind in layout.interleaved else 1)
            weight = (width, hidden) if "down" in kind else (hidden, rows)
            expected[f"{block}{kind}.weight"] = (*weight, experts)
            if layout.biases:
                expected[f"{block}{kind}.bias"] = (weight[1], experts)
        expected[f"{block}ffn_gate_inp.weight"] = (hidden, experts)
        if layout.correction_bias:
            expected[f"{block}exp_probs_b.bias"] = (experts,)
        if shared:
            for kind in ("ffn_gate_shexp", "ffn_up_shexp"):
                expected[f"{block}{kind}.weight"] = (hidden, shared)
            expected[f"{block}ffn_down_shexp.weight"] = (shared, hidden)
    return expected


def check_experts(directory: GgufDirectory, layout: StackedExperts, config: Any) -> None:
    """Check every sparse layer has the tensors `expected_expert_tensors` names, with
    those shapes.

    Raises:
        GgufExpertsError: naming the missing or mis-shaped tensor.
    """
    by_name = {tensor.name: tensor for tensor in directory.tensors}
    for name, shape in expected_expert_tensors(layout, config).items():
        tensor = by_name.get(name)
        if tensor is None:
            raise GgufExpertsError(f"the GGUF has no {name} (a sparse layer's tensor)")
        if tensor.shape != shape:
            raise GgufExpertsError(
                f"{name} has shape {tensor.shape}, expected {shape} (GGUF order: in, out, experts)"
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
    own, and `quantization_config` "mxfp4" where its stacked expert weights are MXFP4; for an
    architecture whose config is built from metadata, `gguf_configs`' fields), as
    `exo.shared.models.moe.moe_geometry_of_config` reads them; empty for a dense
    architecture or a file without `<arch>.expert_count`.

    Raises:
        GgufConfigError: a metadata-built config's key is missing (named).
    """
    from exo.download.gguf_configs import METADATA_CONFIGS

    layout = GGUF_EXPERT_LAYOUTS.get(directory.architecture)
    architecture = directory.architecture
    experts = directory.metadata.get(f"{architecture}.expert_count")
    if layout is None or not experts:
        return {}
    if architecture in METADATA_CONFIGS:
        return METADATA_CONFIGS[architecture](directory)
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": directory.metadata.get(f"{architecture}.expert_used_count"),
        "num_hidden_layers": directory.metadata.get(f"{architecture}.block_count"),
    }
    for key, field_name in layout.config_fields.items():
        fields[field_name] = directory.metadata.get(f"{architecture}.{key}")
    fields.update(layout.config_values)
    if any(
        tensor.type_name in GGUF_MXFP4_TYPES and stacked_kind(tensor.name, layout) is not None
        for tensor in directory.tensors
    ):  # as the converted config states it (`gguf_gptoss.gptoss_config`)
        fields["quantization_config"] = {"quant_method": "mxfp4"}
    return fields
