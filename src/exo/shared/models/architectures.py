"""The config `architectures` names the torch engine has a model family file for.

The API checks a custom model's architecture against `SERVED_ARCHITECTURES` (these and the
encoders) before it asks the cluster to add it (`POST /models/add`, `GET /models/search`);
the API must not import the engine (torch, the family files) to know it. The engine's
family registry (`exo.worker.engines.torch.model.families.supported_architectures`) is the
source of truth: `test_families.py::test_shared_architecture_table_matches_the_family_files`
fails when a family file is added without its names here.
"""

from __future__ import annotations

ENGINE_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
    "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3ForCausalLM",
    "Qwen3VLForConditionalGeneration",
    "MistralForCausalLM",
    "Mistral3ForConditionalGeneration",
    "Phi3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Qwen3MoeForCausalLM",
    "Glm4MoeForCausalLM",
    "MixtralForCausalLM",
    "MiniMaxM2ForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
)
"""Every architecture name (text model and `*ForConditionalGeneration` wrapper) that
some family file covers, in the registry's order."""

ENCODER_ARCHITECTURES: tuple[str, ...] = (
    "BertModel",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
    "NomicBertModel",
    "Gemma3TextModel",
)
"""Architectures the engine serves with its own encoder forward
(`exo.worker.engines.torch.embedding.encoder_models`, `EncoderEngine`): BERT-style encoders
(all-MiniLM, bge-m3, nomic-embed-text, the bge cross-encoder reranker) and EmbeddingGemma
(Gemma 3 text with bidirectional attention). Embedding or reranking only: no decoding, no
KV cache, the whole model on one node."""


SERVED_ARCHITECTURES: tuple[str, ...] = ENGINE_ARCHITECTURES + ENCODER_ARCHITECTURES
"""Every architecture a card may name and be placed (`place_instance`): the decoders' family
files and the encoders. `POST /models/add`, `GET /models/search` and `GET /models/on_disk`
judge a model by this table, as placement does."""


def is_encoder_architecture(architecture: str) -> bool:
    """Whether the encoder engine serves a card of `architecture` (`ENCODER_ARCHITECTURES`)."""
    return architecture in ENCODER_ARCHITECTURES


MODEL_TYPE_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}
"""Config model types transformers has no class for, read as the model type whose
architecture they declare: Kimi-K2's `kimi_k2` (custom code in its repository) is
DeepseekV3ForCausalLM's `deepseek_v3` with other sizes. The engine loads such a config
without the repository's code, so `POST /models/add` does not ask for
`--trust-remote-code` for it."""


TEXT_MODEL_TYPE_ALIASES: dict[str, str] = {"qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}
"""Text configs of multimodal checkpoints that transformers builds no causal LM for, read
as the text model type they are: Qwen2.5-VL's text model is Qwen2's decoder (q/k/v
biases, the same tensor names) whose rotary positions are multimodal (`mrope_section` in
its `rope_parameters`, kept in the aliased config; the engine's direct forward applies
them: `exo.worker.engines.torch.model.qwen2_5_vl_vision`); Qwen3-VL's is Qwen3's decoder
(per-head q/k norms), its multimodal rotary interleaved (`qwen3_vl_vision`)."""

MROPE_INTERLEAVED_TEXT_MODEL_TYPES: frozenset[str] = frozenset({"qwen3_vl_text"})
"""Aliased text model types whose multimodal rotary frequencies interleave the three
position rows: transformers' Qwen3-VL always does, whatever `mrope_interleaved` its config
says, so the aliased config says it (`rope_parameters["mrope_interleaved"]`)."""
