"""The decisions of the embeddings and rerank routes' fields (`test_declared_fields`)."""

from __future__ import annotations

from exo.api.tests.field_decisions import (
    EMBEDDINGS,
    OLLAMA_EMBED,
    OLLAMA_EMBEDDINGS,
    RERANK,
    Decision,
    NoOp,
    Refused,
    Sends,
    Shows,
    embedding_params,
    fields,
)


def embeddings_effects() -> list[Decision]:
    return [
        # OpenAI
        Refused(fields("EmbeddingRequest.model"), EMBEDDINGS, {"model": ""}, "model"),
        Refused(fields("EmbeddingRequest.input"), EMBEDDINGS, {"input": []}, "input"),
        Shows(
            fields("EmbeddingRequest.encoding_format"),
            EMBEDDINGS,
            {"encoding_format": "base64"},
            lambda answer: isinstance(answer["json"]["data"][0]["embedding"], str),
        ),
        Refused(fields("EmbeddingRequest.dimensions"), EMBEDDINGS, {"dimensions": 8}, "dimensions"),
        NoOp(fields("EmbeddingRequest.user"), EMBEDDINGS, {"user": "someone"}, "`user`"),
        # Ollama /api/embed
        Refused(fields("OllamaEmbedRequest.model"), OLLAMA_EMBED, {"model": ""}, "model"),
        Sends(
            fields("OllamaEmbedRequest.input"),
            OLLAMA_EMBED,
            {"input": ["a", "b"]},
            lambda command: embedding_params(command).inputs == ("a", "b"),
        ),
        Sends(
            fields("OllamaEmbedRequest.truncate"),
            OLLAMA_EMBED,
            {"truncate": False},
            lambda command: not embedding_params(command).truncate,
        ),
        Refused(
            fields("OllamaEmbedRequest.dimensions"), OLLAMA_EMBED, {"dimensions": 8}, "dimensions"
        ),
        Sends(
            fields("OllamaEmbedRequest.keep_alive"),
            OLLAMA_EMBED,
            {"keep_alive": "5m"},
            lambda command: command.keep_alive is not None and command.keep_alive.seconds == 300,
        ),
        NoOp(
            fields("OllamaEmbedRequest.options"),
            OLLAMA_EMBED,
            {"options": {"temperature": 0}},
            "`options`",
        ),
        # Ollama /api/embeddings (legacy)
        Refused(fields("OllamaEmbeddingsRequest.model"), OLLAMA_EMBEDDINGS, {"model": ""}, "model"),
        Sends(
            fields("OllamaEmbeddingsRequest.prompt"),
            OLLAMA_EMBEDDINGS,
            {"prompt": "x y"},
            lambda command: embedding_params(command).inputs == ("x y",),
        ),
        Sends(
            fields("OllamaEmbeddingsRequest.keep_alive"),
            OLLAMA_EMBEDDINGS,
            {"keep_alive": "5m"},
            lambda command: command.keep_alive is not None and command.keep_alive.seconds == 300,
        ),
        NoOp(
            fields("OllamaEmbeddingsRequest.options"),
            OLLAMA_EMBEDDINGS,
            {"options": {"temperature": 0}},
            "`options`",
        ),
        # Rerank
        Refused(fields("RerankRequest.model"), RERANK, {"model": ""}, "model"),
        Sends(
            fields("RerankRequest.query"),
            RERANK,
            {"query": "zzz"},
            lambda command: embedding_params(command).query == "zzz",
        ),
        Sends(
            fields("RerankRequest.documents", "RerankDocument.text"),
            RERANK,
            {"documents": ["a", {"text": "object"}]},
            lambda command: embedding_params(command).inputs == ("a", "object"),
        ),
        Shows(
            fields("RerankRequest.top_n"),
            RERANK,
            {"top_n": 1},
            lambda answer: len(answer["json"]["results"]) == 1,
        ),
        Shows(
            fields("RerankRequest.return_documents"),
            RERANK,
            {"return_documents": False},
            lambda answer: "document" not in answer["json"]["results"][0],
        ),
    ]
