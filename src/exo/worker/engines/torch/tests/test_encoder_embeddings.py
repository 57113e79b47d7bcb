"""The encoder embedding models (issue 42, item 2) against the reference implementations on
tiny random-weight models, through the backend's real path (`load_encoder_model` on a saved
folder, `tokenize`, `embed` / `score_pairs`):
- each family's embedding equals sentence-transformers' `encode` (which runs transformers'
  model and the folder's own pooling and dense modules) within 1e-5 cosine in float32, a batch
  with padding equals each input alone;
- the cross-encoder's scores equal transformers' `XLMRobertaForSequenceClassification` logits
  within 1e-4;
- the folder's files come through the loopback Hub with the model;
- what is not computed is refused naming the field.
BERT and EmbeddingGemma run by default; NomicBERT and XLM-RoBERTa are marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from exo.download.hub_download import HubDownload, download_from_hub
from exo.download.shard_files import small_files
from exo.testing.hf_server import HubServer
from exo.testing.tiny_encoders import save_tiny_embedding_model, save_tiny_reranker
from exo.worker.engines.torch.embedding.encoder_models import load_encoder_model
from exo.worker.engines.torch.embedding.weights import EmbeddingModelError

TEXTS = [
    "w1 w2 w3",
    "w5",
    "w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 unknown",  # longer than EmbeddingGemma's window
    "w0 w0 w3 w4 w5 w6 w7",
]


def _sentence_transformers_embeddings(directory: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(directory), device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


@pytest.mark.parametrize(
    "family",
    [
        "bert",  # the default run's encoder family; the others are marked slow
        pytest.param("embeddinggemma", marks=pytest.mark.slow),
        pytest.param("nomic_bert", marks=pytest.mark.slow),
        pytest.param("xlm-roberta", marks=pytest.mark.slow),
    ],
)
def test_a_family_embeds_as_sentence_transformers_does(family: str, tmp_path: Path) -> None:
    directory = save_tiny_embedding_model(tmp_path / family, family)
    model = load_encoder_model(directory)
    token_ids = model.tokenize(TEXTS)
    batch = model.embed(token_ids)
    assert batch.dtype == torch.float32 and batch.shape == (len(TEXTS), model.dimensions)
    reference = _sentence_transformers_embeddings(directory, TEXTS)
    cosine = F.cosine_similarity(batch, reference)
    assert (1 - cosine).abs().max().item() < 1e-5, cosine
    alone = torch.cat([model.embed([ids]) for ids in token_ids])
    assert torch.allclose(batch, alone, atol=1e-5, rtol=1e-5)
    # The inputs differ, so a wrong mask or pooling could not pass by sameness.
    assert F.cosine_similarity(batch[0], batch[2], dim=0) < 0.999


def test_the_backend_states_its_shapes_and_special_tokens(tmp_path: Path) -> None:
    gemma = load_encoder_model(
        save_tiny_embedding_model(tmp_path / "gemma", "embeddinggemma"),
        matryoshka_dimensions=(32, 16),
    )
    # EmbeddingGemma's 2_Dense (32 -> 64) and 3_Dense (64 -> 32).
    assert gemma.dimensions == 32 and gemma.matryoshka_dimensions == (32, 16)
    assert gemma.max_input_tokens == 256  # the tiny config's max_position_embeddings
    assert gemma.tokenize(["w0 w1"]) == [[2, 4, 5, 1]]  # <bos> w0 w1 <eos>
    # An empty text is its special tokens alone, and embeds (Ollama's `/api/embed` sends it).
    assert gemma.tokenize([""]) == [[2, 1]]
    assert len(gemma.embed([[2, 1]])[0]) == 32
    assert gemma.score_pairs([("w1", "w2")]) is None
    with pytest.raises(ValueError, match="input 1 has 257 tokens"):
        gemma.embed([[2, 1], [4] * 257])
    with pytest.raises(ValueError, match="input 0 has no tokens"):
        gemma.embed([[]])
    with pytest.raises(
        ValueError, match=r"input 1 has a token id outside the vocabulary \[0, 44\)"
    ):
        gemma.embed([[2, 1], [2, 44, 1]])
    with pytest.raises(EmbeddingModelError, match="do not fit"):
        load_encoder_model(tmp_path / "gemma", matryoshka_dimensions=(64,))


def test_inputs_are_grouped_by_length_within_the_bounds() -> None:
    from exo.worker.engines.torch.embedding.encoder_models import _length_groups

    lengths = [5, 3, 9000, 8000, 4, 70] + [10] * 70
    groups = _length_groups(lengths)
    assert sorted(index for group in groups for index in group) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) <= 64 and (len(group) * longest <= 16384 or len(group) == 1)
        assert lengths[group[-1]] == longest
    assert [2] in groups and [3] in groups  # each long input alone


@pytest.mark.slow  # the default run checks one encoder family, BERT (docs/testing.md)
def test_the_reranker_scores_as_transformers_does(tmp_path: Path) -> None:
    """Scores are the sigmoid of transformers' one logit (CrossEncoder's and TEI's scale)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = save_tiny_reranker(tmp_path / "reranker")
    pairs = [
        ("w1 w2", "w3 w4 w5 w6"),
        ("w9", "w1"),
        ("w1 w2 w3 w4", "w5 w6 w7 w8 w9 w10 w11 w12"),
    ]
    scores = load_encoder_model(directory).score_pairs(pairs)
    assert scores is not None and scores.dtype == torch.float32 and scores.shape == (3,)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    reference_model = AutoModelForSequenceClassification.from_pretrained(str(directory)).eval()
    features = tokenizer(
        [query for query, _ in pairs], [document for _, document in pairs],
        padding=True, return_tensors="pt",
    )  # fmt: skip
    with torch.no_grad():
        reference = torch.sigmoid(reference_model(**features).logits[:, 0])
    assert torch.allclose(scores, reference, atol=1e-4), (scores, reference)
    assert (scores.max() - scores.min()).item() > 1e-2  # distinct pairs score apart


def test_an_embedding_folder_downloads_with_its_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the loopback Hub: EmbeddingGemma's module folders (pooling, both dense
    projections) arrive with the model and the downloaded folder embeds as the original."""
    original = save_tiny_embedding_model(tmp_path / "original", "embeddinggemma")
    (original / "onnx").mkdir()
    (original / "onnx" / "model.onnx").write_bytes(b"not read")
    with HubServer() as server:
        server.add_directory("someone/tiny-embeddinggemma", original)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent/exo-test-token")
        download = HubDownload(
            "someone/tiny-embeddinggemma", "someone/tiny-embeddinggemma", "main", None,
            tmp_path / "downloaded",
        )  # fmt: skip
        directory = download_from_hub(download)
        fetched = server.files_downloaded("someone/tiny-embeddinggemma")
    assert {"modules.json", "1_Pooling/config.json", "2_Dense/model.safetensors"} <= fetched
    assert {"3_Dense/config.json", "3_Dense/model.safetensors"} <= fetched
    assert "onnx/model.onnx" not in fetched and "README.md" not in fetched
    texts = TEXTS[:2]
    downloaded, source = load_encoder_model(directory), load_encoder_model(original)
    assert torch.equal(
        downloaded.embed(downloaded.tokenize(texts)), source.embed(source.tokenize(texts))
    )


def test_which_files_a_sentence_transformers_repository_needs() -> None:
    files = [
        "config.json", "model.safetensors", "tokenizer.json", "modules.json",
        "sentence_bert_config.json", "config_sentence_transformers.json",
        "1_Pooling/config.json", "2_Dense/config.json", "2_Dense/model.safetensors",
        "2_Dense/pytorch_model.bin", "onnx/model.onnx", "colbert_linear.pt", "README.md",
    ]  # fmt: skip
    assert small_files(files) == (
        "1_Pooling/config.json", "2_Dense/config.json", "2_Dense/model.safetensors",
        "config.json", "config_sentence_transformers.json", "modules.json",
        "sentence_bert_config.json", "tokenizer.json",
    )  # fmt: skip
    # Without modules.json a numbered folder is nothing exo reads.
    assert small_files(["config.json", "1_Pooling/config.json"]) == ("config.json",)


def _rewrite_json(path: Path, change: dict[str, Any], drop: tuple[str, ...] = ()) -> None:
    content = json.loads(path.read_text())
    content = {key: value for key, value in content.items() if key not in drop}
    path.write_text(json.dumps({**content, **change}))


def test_the_published_layouts_of_the_files_load_alike(tmp_path: Path) -> None:
    """The Hub's files are older than sentence-transformers 6 and transformers 5: NomicBERT's
    custom-code config names (`n_embd`, `rotary_emb_base`, ...), sentence-transformers 2-5's
    pooling flags and module paths, Gemma 3's `rope_theta` / `rope_local_base_freq`. Each,
    rewritten into a tiny folder, embeds exactly as the folder sentence-transformers 6 saved
    (which the family tests hold to the reference)."""
    texts = TEXTS[:3]

    def embedded(directory: Path) -> torch.Tensor:
        model = load_encoder_model(directory)
        return model.embed(model.tokenize(texts))

    nomic = save_tiny_embedding_model(tmp_path / "nomic", "nomic_bert")
    before = embedded(nomic)
    _rewrite_json(
        nomic / "config.json",
        {
            "n_embd": 32, "n_head": 4, "n_layer": 2, "n_inner": 48, "n_positions": 8192,
            "max_trained_positions": 2048, "layer_norm_epsilon": 1e-12, "rotary_emb_base": 1000,
            "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "prenorm": False,
            "activation_function": "swiglu", "qkv_proj_bias": False, "mlp_fc1_bias": False,
        },
        drop=(
            "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
            "layer_norm_eps", "rope_parameters", "max_position_embeddings", "hidden_act",
        ),
    )  # fmt: skip
    assert load_encoder_model(nomic).max_input_tokens == 2048
    assert torch.equal(embedded(nomic), before)

    bert = save_tiny_embedding_model(tmp_path / "bert", "bert")
    before = embedded(bert)
    modules = json.loads((bert / "modules.json").read_text())
    for entry in modules:
        entry["type"] = "sentence_transformers.models." + entry["type"].rsplit(".", 1)[-1]
    (bert / "modules.json").write_text(json.dumps(modules))
    _rewrite_json(
        bert / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": 32, "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
        },
        drop=("embedding_dimension", "pooling_mode"),
    )  # fmt: skip
    (bert / "sentence_bert_config.json").write_text('{"max_seq_length": 20}')
    assert load_encoder_model(bert).max_input_tokens == 20
    assert torch.equal(embedded(bert), before)

    gemma = save_tiny_embedding_model(tmp_path / "gemma", "embeddinggemma")
    before = embedded(gemma)
    _rewrite_json(
        gemma / "config.json",
        {"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None},
        drop=("rope_parameters",),
    )
    assert torch.equal(embedded(gemma), before)


def test_what_is_not_computed_is_refused_by_name(tmp_path: Path) -> None:
    directory = save_tiny_embedding_model(tmp_path / "bert", "bert")
    pooling = directory / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"embedding_dimension": 32, "pooling_mode": "max"}))
    with pytest.raises(EmbeddingModelError, match="pooling mode 'max'"):
        load_encoder_model(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(EmbeddingModelError, match="model_type 'llama'"):
        load_encoder_model(directory)


def test_the_embedding_cards_count_what_transformers_builds() -> None:
    """Each embedding card's `parameter_count` equals the weights of transformers' model built
    (on the meta device) with the card's shapes and the positions, token types and pooler its
    config states, and the shared `encoder_parameter_count` leaves out exactly those. The
    Qwen3 embedding cards count `Qwen3Model` (the bare decoder sentence-transformers saves,
    no LM head, although the 8B's base model unties it), the reranker `Qwen3ForCausalLM`
    (its yes/no logits need the head, tied)."""
    from transformers import (
        BertConfig,
        BertModel,
        Gemma3TextConfig,
        Gemma3TextModel,
        NomicBertConfig,
        NomicBertModel,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3Model,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
        XLMRobertaModel,
    )

    from exo.shared.models.cards import load_builtin_cards
    from exo.shared.models.parameter_count import decoder_parameter_count
    from exo.shared.types.common import ModelId

    cards = load_builtin_cards()

    def shapes(model_id: str) -> dict[str, Any]:
        card = cards[ModelId(model_id)]
        return {
            "hidden_size": card.hidden_size, "num_hidden_layers": card.n_layers,
            "num_attention_heads": card.num_attention_heads, "vocab_size": card.vocab_size,
            "intermediate_size": card.intermediate_size,
        }  # fmt: skip

    one_label: dict[str, Any] = {"num_labels": 1}
    roberta: dict[str, Any] = {
        "max_position_embeddings": 8194,
        "type_vocab_size": 1,
        "pad_token_id": 1,
    }
    gemma = cards[ModelId("google/embeddinggemma-300m")]

    def qwen3(model_id: str) -> Qwen3Config:
        card = cards[ModelId(model_id)]
        return Qwen3Config(
            **shapes(model_id), num_key_value_heads=card.num_key_value_heads,
            head_dim=card.attention_head_dim, tie_word_embeddings=card.tie_word_embeddings,
        )  # fmt: skip

    qwen3_embeddings = [f"Qwen/Qwen3-Embedding-{size}" for size in ("0.6B", "4B", "8B")]
    with torch.device("meta"):
        for model_id in qwen3_embeddings:
            card = cards[ModelId(model_id)]
            bare = sum(parameter.numel() for parameter in Qwen3Model(qwen3(model_id)).parameters())
            assert card.parameter_count == decoder_parameter_count(card) == bare, model_id
            assert card.storage_size_bytes == 2 * bare, model_id  # bf16 as published
            assert card.embedding_pooling == "last" and card.capabilities == ("embedding",)
        reranker = cards[ModelId("Qwen/Qwen3-Reranker-0.6B")]
        causal = Qwen3ForCausalLM(qwen3("Qwen/Qwen3-Reranker-0.6B"))
        weights = sum(parameter.numel() for parameter in causal.parameters())
        assert reranker.parameter_count == decoder_parameter_count(reranker) == weights
        assert reranker.storage_size_bytes == 2 * weights
        assert reranker.capabilities == ("rerank",)
        built = {
            # (model, weights the card's shapes do not give: positions, token types, pooler)
            "sentence-transformers/all-MiniLM-L6-v2": (
                BertModel(BertConfig(**shapes("sentence-transformers/all-MiniLM-L6-v2"))),
                512 * 384 + 2 * 384 + 384 * 384 + 384,
            ),
            "BAAI/bge-m3": (
                XLMRobertaModel(XLMRobertaConfig(**shapes("BAAI/bge-m3"), **roberta)),
                8194 * 1024 + 1024 + 1024 * 1024 + 1024,
            ),
            "BAAI/bge-reranker-v2-m3": (
                XLMRobertaForSequenceClassification(
                    XLMRobertaConfig(**shapes("BAAI/bge-reranker-v2-m3"), **roberta, **one_label)
                ),
                8194 * 1024 + 1024,
            ),
            "nomic-ai/nomic-embed-text-v1.5": (
                NomicBertModel(NomicBertConfig(**shapes("nomic-ai/nomic-embed-text-v1.5"))),
                2 * 768,
            ),
            "google/embeddinggemma-300m": (
                Gemma3TextModel(
                    Gemma3TextConfig(
                        **shapes("google/embeddinggemma-300m"),
                        num_key_value_heads=gemma.num_key_value_heads,
                        head_dim=gemma.attention_head_dim,
                    )
                ),
                0,
            ),
        }
    for model_id, (model, unstated) in built.items():
        weights = sum(parameter.numel() for parameter in model.parameters())
        card = cards[ModelId(model_id)]
        dense = 2 * 768 * 3072 if model_id == "google/embeddinggemma-300m" else 0
        assert card.parameter_count == weights + dense, model_id
        assert decoder_parameter_count(card) == weights - unstated, model_id
        assert "embedding" in card.capabilities or "rerank" in card.capabilities
