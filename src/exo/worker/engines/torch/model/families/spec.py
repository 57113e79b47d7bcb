"""What the engine must know about a model family, in one value per family.

A family file (`llama.py`, `gemma3.py`, ...) builds one `ModelFamily`; loading, sharding,
quantization, fusion, the KV cache, the lean forward and the tests' tiny models read it and
nothing else (the habit of mlx-lm's `models/<family>.py`: one place per architecture). The
modules stay transformers'; the lean forward (`model/direct_forward.py`) walks them as the spec's
`DecoderLayout` says, and transformers' own forward is the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

# Sizes of the parts of a fused column-parallel linear along its output dimension, from the
# (text) config: e.g. (query, key, value) widths of a fused `qkv_proj`.
FusedParts = Callable[[PretrainedConfig], tuple[int, ...]]
# Per decoder layer: the attention window in tokens, or None for full attention.
AttentionWindows = Callable[[PretrainedConfig], tuple[int | None, ...]]
# A random-weight model of the family from the common tiny settings (hidden size, heads,
# layers, vocabulary, ...), built with the real transformers classes.
TinyModelBuilder = Callable[[dict[str, Any]], PreTrainedModel]
# Adjusts one decoder layer after its linears were split over `world_size` tensor ranks,
# for attention code that reads head counts from somewhere other than tensor shapes.
TensorSplitHook = Callable[[nn.Module, PretrainedConfig, int], None]
# An expert's gated activation from its gate and up projections' outputs (`[n, intermediate]`
# each) to the down projection's input, for a family whose experts are not `act(gate) * up`.
ExpertActivation = Callable[[Any, Any], Any]

# `*ForConditionalGeneration` checkpoints (Gemma 3 4B+, Mistral-Small 3.1) keep the text
# model under this prefix, next to the vision tower the text engine does not load.
LANGUAGE_MODEL_PREFIX = "language_model."


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no family file, or its structure is not what the
    family file says."""


def uniform_attention_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Every layer attends within `config.sliding_window` tokens when it is set (Mistral
    7B v0.1, Phi-3-mini), else over the whole context (Llama, Gemma)."""
    window = getattr(config, "sliding_window", None)
    return tuple(window if isinstance(window, int) else None for _ in range(_layers(config)))


def attention_windows_from_layer_types(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Windows from the config's per-layer `layer_types` ("sliding_attention" layers use
    `sliding_window`; Gemma 3, Qwen2/3 with `use_sliding_window`), else uniform."""
    layer_types = getattr(config, "layer_types", None)
    if not isinstance(layer_types, list | tuple):
        return uniform_attention_windows(config)
    window = getattr(config, "sliding_window", None)
    return tuple(
        window if kind == "sliding_attention" and isinstance(window, int) else None
        for kind in layer_types
    )


def _layers(config: PretrainedConfig) -> int:
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int):
        raise UnsupportedArchitectureError(f"{type(config).__name__} has no num_hidden_layers")
    return count


@dataclass(frozen=True, slots=True)
class Routing:
    """How each token picks its experts in one model (values read from its config).

    A token's router logits `[experts]` become scores (`scoring`: softmax over experts, or
    an independent sigmoid each); the experts chosen are the `experts_per_token` highest
    scores plus the correction bias where the family has one (DeepSeek-V3's
    `e_score_correction_bias`: it moves the choice, not the weights), first keeping only
    the `groups_per_token` best of `groups` equal groups of experts where `groups` > 1
    (DeepSeek-V3's group-limited routing: a group's score is the sum of its two best).
    The chosen experts' scores, divided by their sum when `normalize` (Qwen3-MoE's
    `norm_topk_prob`), times `scaling` (`routed_scaling_factor`), weight their outputs.

    Attributes:
        experts: routed experts per MoE layer (the config's `experts_field`).
        experts_per_token: experts each token is sent to (`num_experts_per_tok`).
        experts_field: the config field the family's checkpoints name `experts` with
            (Qwen3-MoE `num_experts`, Mixtral `num_local_experts`, DeepSeek-V3
            `n_routed_experts`), for refusals.
    """

    experts: int
    experts_per_token: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    normalize: bool = False
    scaling: float = 1.0
    groups: int = 1
    groups_per_token: int = 1
    experts_field: str = "num_experts"

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.experts:
            raise UnsupportedArchitectureError(
                f"num_experts_per_tok={self.experts_per_token} must be between 1 and "
                f"{self.experts_field}={self.experts}"
            )
        if self.experts % self.groups or not 0 < self.groups_per_token <= self.groups:
            raise UnsupportedArchitectureError(
                f"{self.experts} experts cannot be routed as the best {self.groups_per_token} "
                f"of {self.groups} groups"
            )


# The routing of a model of the family, from its (text) config.
RoutingOfConfig = Callable[[PretrainedConfig], Routing]
# The experts' gated activation of a model of the family, from its (text) config.
ExpertActivationOfConfig = Callable[[PretrainedConfig], ExpertActivation]


@dataclass(frozen=True, slots=True)
class FusedExpertTensors:
    """A checkpoint that stores each MoE layer's experts stacked in a few tensors (gpt-oss)
    instead of one per expert and linear; the loader cuts each expert's linears out of them
    (`model/fused_experts.py`), an expert-parallel rank reading only its experts' slices.

    Names are relative to the experts module (`mlp.experts.gate_up_proj`):
        gate_up: `[experts, hidden, 2 * intermediate]` (input-major), gate and up
            interleaved along the last dimension (gate at even, up at odd columns);
        down: `[experts, intermediate, hidden]` (input-major);
        each with a `<name>_bias` `[experts, out]` where the experts have biases.
    Quantized as MXFP4 (`quantization_config.quant_method = "mxfp4"`), the same tensors are
    `<name>_blocks` `[experts, out, in / 32, 16]` uint8 and `<name>_scales` `[experts, out,
    in / 32]` (output-major; gate and up interleaved by rows).
    """

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"


def config_scoring(
    config: PretrainedConfig, family: str, scoring: Literal["softmax", "sigmoid"]
) -> Literal["softmax", "sigmoid"]:
    """The family's router scoring, checked against the config's `scoring_func` where it
    states one (DeepSeek-V3 and MiniMax-M2 configs do; transformers' modules of a family
    implement one function only, whatever the field says).

    Raises:
        UnsupportedArchitectureError: `scoring_func` names another function.
    """
    stated = getattr(config, "scoring_func", None)
    if stated is not None and stated != scoring:
        raise UnsupportedArchitectureError(
            f"scoring_func={stated!r}: the {family} family routes with {scoring} scores only"
        )
    return scoring


@dataclass(frozen=True, slots=True)
class MixtureOfExperts:
    """Where a family keeps a sparse MLP block, relative to a decoder layer. Which layers are
    sparse is transformers' decision when it builds the model (Qwen3-MoE's
    `decoder_sparse_step` / `mlp_only_layers`): a layer whose `experts` module exists is a
    MoE layer, any other has the dense MLP of the family's `DecoderLayout`. Placement reads
    the same facts from the config (`exo.shared.models.moe`).

    At load the experts module transformers builds (Qwen3-MoE's stacked 3-D weights) is
    replaced by `model.moe.RoutedExperts`: one gated MLP per expert, named as checkpoints
    name them (`experts.N.gate_proj`), which loads, quantizes and splits like any linear.

    Attributes:
        routing: the model's `Routing` from its config.
        router: the linear scoring experts (weight `[experts, hidden]`; held float32).
        experts: the routed experts module.
        expert_gate_up / expert_down: an expert's linears, relative to `experts.N`.
        correction_bias: a `[experts]` bias added to the scores for the choice only.
        shared_expert: a dense gated MLP (gate_proj, up_proj, down_proj) every token also
            goes through (DeepSeek-V3, GLM-4.5), None where absent.
        shared_expert_gate: a `[1, hidden]` linear whose sigmoid scales the shared expert's
            output (Qwen2-MoE), None where absent.
        expert_width: the config field of an expert's width (Mixtral and MiniMax-M2 size
            their experts by `intermediate_size`).
        expert_bias: the experts' linears have biases (gpt-oss); the router's bias, where
            the router module has one, is read whatever this says.
        expert_activation: the experts' gated activation from the config (gpt-oss's clamped
            SwiGLU), None for `act_fn(gate) * up` with the experts module's `act_fn`.
        fused_checkpoint: how a checkpoint stacks the experts (None: one tensor per expert
            and linear, `experts.N.gate_proj.weight`). Transformers' skeleton then holds
            them input-major (`gate_up_proj` `[experts, hidden, 2 * intermediate]`).
    """

    routing: RoutingOfConfig
    router: str = "mlp.gate"
    experts: str = "mlp.experts"
    expert_gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    expert_down: str = "down_proj"
    correction_bias: str | None = None
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    expert_width: str = "moe_intermediate_size"
    expert_bias: bool = False
    expert_activation: ExpertActivationOfConfig | None = None
    fused_checkpoint: FusedExpertTensors | None = None

    def expert_linear(self, linear_path: str) -> str | None:
        """The expert-relative name of a layer-relative path inside an expert
        (`"mlp.experts.3.gate_proj"` → `"gate_proj"`), else None."""
        head = self.experts + "."
        if not linear_path.startswith(head):
            return None
        index, _, name = linear_path[len(head) :].partition(".")
        return name if index.isdigit() and name else None


@dataclass(frozen=True, slots=True)
class DecoderLayout:
    """How the lean forward (`model/direct_forward.py`) walks one decoder layer: module paths
    relative to the layer, and the family's variations on the Llama layer.

    Attributes:
        qkv: the Q, K, V projections in that order (fused into one matmul), or one path of
            an already fused `qkv_proj` (Phi-3).
        gate_up: the gate and up projections (fused), or one fused `gate_up_proj`.
        output / down: the attention output and MLP down projections (row-parallel).
        input_norm: the norm before attention.
        pre_mlp_norm: the norm before the MLP.
        post_attention_norm / post_mlp_norm: norms of the attention / MLP output before
            the residual add (Gemma 3's "sandwich" norms), None where absent.
        qk_norms: RMSNorms of queries and keys before rotary (Qwen3, Gemma 3), absent in
            a model whose config turns them off (GLM-4.5's `use_qk_norm`).
        qk_norms_per_head: each head normalized alone (Qwen3), or all of a projection's
            heads together (MiniMax-M2: one RMSNorm over `heads * head_dim`).
        norm_offset: RMSNorms scale by `norm_offset + weight` (Gemma's `1 + weight`: 1.0).
        rope_per_layer_type: the rotary module takes the layer type (Gemma 3: local
            sliding layers use another base frequency).
        rotary_per_frequency: the rotary module gives cos / sin once per frequency
            (`[T, head_dim / 2]`, applied to both halves of a head: gpt-oss), not per value.
        attention_sinks: a learned `[heads]` logit per head that joins each query's softmax
            denominator and attends to nothing (gpt-oss's `self_attn.sinks`), None where absent.
        latent_attention: multi-head latent attention (DeepSeek-V3's `self_attn` with
            `kv_a_proj_with_mqa` / `kv_b_proj`; `direct_forward_mla`) in place of `qkv`,
            over a KV cache of one compressed head per token.
    The activation is read from the MLP module; the embedding's scale (Gemma's
    `sqrt(hidden)`) is inside the model's embedding module, which the lean forward calls.
    """

    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    output: str = "self_attn.o_proj"
    down: str = "mlp.down_proj"
    input_norm: str = "input_layernorm"
    pre_mlp_norm: str = "post_attention_layernorm"
    post_attention_norm: str | None = None
    post_mlp_norm: str | None = None
    qk_norms: tuple[str, str] | None = None
    qk_norms_per_head: bool = True
    norm_offset: float = 0.0
    rope_per_layer_type: bool = False
    rotary_per_frequency: bool = False
    attention_sinks: str | None = None
    latent_attention: bool = False


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One model family's facts for the engine.

    Linear paths are relative to a decoder layer (`"self_attn.q_proj"`). Column-parallel
    linears are split by output rows over tensor ranks, row-parallel ones by input columns
    (their partial sums are all-reduced); a fused column linear (in `fused_parts`) is split
    part by part, so every rank holds its slice of each part, in order.

    Attributes:
        name: the family's short name (also the tiny model's name in tests).
        architectures: config `architectures` names whose checkpoints hold the text model
            at the top level (`model.layers.N...`, `lm_head`).
        wrapped_architectures: `*ForConditionalGeneration` names whose checkpoints hold it
            under `LANGUAGE_MODEL_PREFIX`; the text model is built from `text_config`.
        wrapped_prefixes: a wrapped architecture's text-model prefix where it is not
            `LANGUAGE_MODEL_PREFIX` ("": top-level names, which `checkpoint_renames` make
            the text model's, as Idefics3's `model.text_model.` beside `lm_head.`).
        column_parallel / row_parallel: the decoder layer's linears by split direction.
        fused_parts: part sizes of fused column-parallel linears.
        rms_norms: RMSNorm classes computing `weight * normalize(x)` (fusable into one
            `rms_norm` kernel); Gemma's `(1 + weight)` norms are not listed.
        attention_windows: the KV cache layout (window per layer).
        tensor_parallel_note: why tensor parallelism is refused for this family (None: it
            is supported where heads divide).
        after_tensor_split: adjusts a layer whose attention reads head counts from config.
        tiny_model: builds a random-weight model of the family for tests and benchmarks.
        tiny_wrapped_config: the `*ForConditionalGeneration` config around a text config,
            for tests of the wrapped checkpoint layout (None: the family has none).
        layout: how the lean forward walks a decoder layer (None: the family runs on
            transformers' modules only).
        moe: where the family's sparse MLP blocks are (None: a dense family). Tensor
            parallelism splits every expert as the dense MLP (gate/up by rows, down by
            columns; one all-reduce per MoE block).
        projection_norms: RMSNorms over a whole column-parallel projection's output
            (MiniMax-M2's q/k norms over all heads): a tensor rank holds its rows of the
            weight, as of the projection, and all-reduces the sum of squares.
        checkpoint_renames: (checkpoint text, model text) replaced in layer tensor names
            where the family's checkpoints name a module otherwise than transformers'
            modules do (Mixtral's `block_sparse_moe.` for `mlp.`).
        per_head_parameters: layer-relative names of `[heads]` tensors that belong to the
            query heads (gpt-oss's `self_attn.sinks`): a tensor rank holds its heads' share.
    """

    name: str
    architectures: tuple[str, ...]
    column_parallel: tuple[str, ...]
    row_parallel: tuple[str, ...]
    rms_norms: tuple[type[nn.Module], ...]
    tiny_model: TinyModelBuilder
    wrapped_architectures: tuple[str, ...] = ()
    wrapped_prefixes: Mapping[str, str] = field(default_factory=dict)
    fused_parts: Mapping[str, FusedParts] = field(default_factory=dict)
    attention_windows: AttentionWindows = uniform_attention_windows
    tensor_parallel_note: str | None = None
    after_tensor_split: TensorSplitHook | None = None
    tiny_wrapped_config: Callable[[PretrainedConfig], PretrainedConfig] | None = None
    layout: DecoderLayout | None = DecoderLayout()
    moe: MixtureOfExperts | None = None
    projection_norms: tuple[str, ...] = ()
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def model_tensor_name(self, checkpoint_name: str) -> str:
        """The model's name of a checkpoint tensor (`checkpoint_renames` applied)."""
        for stored, model in self.checkpoint_renames:
            checkpoint_name = checkpoint_name.replace(stored, model)
        return checkpoint_name

    per_head_parameters: tuple[str, ...] = ()

    def checkpoint_prefix(self, architecture: str) -> str:
        """The prefix of the text model's tensor names in a checkpoint of `architecture`."""
        if architecture not in self.wrapped_architectures:
            return ""
        return self.wrapped_prefixes.get(architecture, LANGUAGE_MODEL_PREFIX)

    def split_direction(self, linear_path: str) -> Literal["column", "row"] | None:
        """ "column", "row" or None (replicated) for a layer-relative linear path."""
        if linear_path in self.column_parallel or linear_path in self.projection_norms:
            return "column"
        if linear_path in self.row_parallel:
            return "row"
        expert_linear = None if self.moe is None else self.moe.expert_linear(linear_path)
        if expert_linear is not None and self.moe is not None:
            if expert_linear in self.moe.expert_gate_up:
                return "column"
            if expert_linear == self.moe.expert_down:
                return "row"
        return None


def widen_tiny_routers(
    model: PreTrainedModel,
    weight_suffix: str,
    std: float,
    bias_suffix: str | None = None,
    bias_std: float = 0.0,
) -> None:
    """Draw a tiny test model's router weights (parameters named `...weight_suffix`) `std`
    wide, and its correction biases (buffers named `...bias_suffix`) `bias_std` wide:
    transformers' initialization leaves routers near zero, where expert choices are near
    ties that float rounding could flip; trained routers decide by clear margins."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(weight_suffix):
                parameter.normal_(0.0, std)
        if bias_suffix is None:
            return
        for name, buffer in model.named_buffers():
            if name.endswith(bias_suffix):
                buffer.normal_(0.0, bias_std)


def standard_attention_and_mlp() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Column- and row-parallel linears of the Llama-style decoder layer (separate q/k/v,
    gated MLP) that most families share."""
    column = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    )
    row = ("self_attn.o_proj", "mlp.down_proj")
    return column, row
