"""One real `exo` node serves encoder models from the loopback Hub, downloaded, placed and
loaded as a user's would be (catalog cards, the real download path with the
sentence-transformers module folders): a tiny BERT (all-MiniLM-L6-v2's card) through the
`openai` and `ollama` clients equal to sentence-transformers, a tiny bge cross-encoder
through `/v1/rerank` equal to the sigmoid of transformers' logit, and Matryoshka `dimensions`
on a tiny NomicBERT (nomic-embed-text-v1.5's card, 768 wide as its widths need); a user's
own BERT folder added by `POST /models/add` (its card built from its files) serves the same.

The node starts with the BERT placed (the default run's encoder check, ~40 s contended); the
slow tests place their model on the same node when they run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import ollama
import openai
import pytest
import torch

from exo.testing.hf_server import HubServer
from exo.testing.processes import ExoNode
from exo.testing.tiny_encoders import save_tiny_embedding_model, save_tiny_reranker

BERT = "sentence-transformers/all-MiniLM-L6-v2"
RERANKER = "BAAI/bge-reranker-v2-m3"
NOMIC = "nomic-ai/nomic-embed-text-v1.5"
TEXTS = ["w1 w2 w3", "w7 w8 w9 w10 w11"]
READY_TIMEOUT_SECONDS = 180.0


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {
        BERT: save_tiny_embedding_model(root / "bert", "bert"),
        RERANKER: save_tiny_reranker(root / "reranker"),
        NOMIC: save_tiny_embedding_model(root / "nomic", "nomic_bert", hidden_size=768),
    }


@pytest.fixture(scope="module")
def hub(folders: dict[str, Path]) -> Iterator[HubServer]:
    with HubServer() as server:
        for repo_id, folder in folders.items():
            server.add_directory(repo_id, folder)
        yield server


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, hub: HubServer) -> Iterator[ExoNode]:
    home = tmp_path_factory.mktemp("encoder-node")
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_CACHE": str(home / "hf-cache"),
        "OLLAMA_MODELS": str(home / "no-ollama"),
    }
    exo = ExoNode(home / "node", home / "models", ("--no-default-model",), env=env)
    try:
        exo.start()
        _serve(exo, BERT)
        yield exo
    finally:
        exo.stop()


def _serve(node: ExoNode, repo_id: str) -> None:
    """Place `repo_id` on `node` (downloaded from the loopback Hub) unless it is, and wait
    until it is ready."""
    if not node.ready_runner_ids(repo_id):
        placed = httpx.post(f"{node.url}/place_instance", json={"model_id": repo_id}, timeout=60)
        assert placed.status_code == 200, placed.text
    node.wait_ready(repo_id, timeout=READY_TIMEOUT_SECONDS)


def _cosine(a: object, b: object) -> float:
    first, second = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(first @ second / np.linalg.norm(first) / np.linalg.norm(second))


def _reference_embeddings(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return np.asarray(model.encode(texts, normalize_embeddings=True, convert_to_numpy=True))


def test_bert_through_openai_and_ollama_equals_sentence_transformers(
    node: ExoNode, hub: HubServer, folders: dict[str, Path]
) -> None:
    # The real download path fetched the sentence-transformers modules with the weights.
    fetched = hub.files_downloaded(BERT)
    assert {"modules.json", "1_Pooling/config.json", "model.safetensors"} <= fetched, fetched
    reference = _reference_embeddings(folders[BERT], TEXTS)
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60)
    answer = client.embeddings.create(model=BERT, input=TEXTS)  # base64, decoded by the SDK
    assert [item.index for item in answer.data] == [0, 1]
    assert answer.usage.prompt_tokens == 3 + 5 + 4  # [CLS] .. [SEP] around each
    for item, expected in zip(answer.data, reference, strict=True):
        assert len(item.embedding) == 32
        assert _cosine(item.embedding, expected) > 1 - 1e-5
    assert _cosine(answer.data[0].embedding, answer.data[1].embedding) < 0.999
    embedded = ollama.Client(host=f"{node.url}/ollama", timeout=60).embed(model=BERT, input=TEXTS)
    for vector, expected in zip(embedded.embeddings, reference, strict=True):
        assert _cosine(vector, expected) > 1 - 1e-5
    chat = httpx.post(
        f"{node.url}/v1/chat/completions",
        json={"model": BERT, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert chat.status_code == 400 and "capability" in chat.text, chat.text
    runner = node.state()["runners"]
    ready = [status for status in runner.values() if status.get("kind") == "RunnerReady"]
    assert ready and all(status["kv_cache_tokens"] == 0 for status in ready)


@pytest.mark.slow  # a second runner (~20 s); the backend's check is test_encoder_embeddings.py
def test_cross_encoder_rerank_sorted_sigmoid_of_transformers(
    node: ExoNode, folders: dict[str, Path]
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _serve(node, RERANKER)
    query, documents = "w1 w2", ["w3 w4 w5", "w1 w2", "w9 w10 w11 w12", "w6"]
    answer = httpx.post(
        f"{node.url}/v1/rerank",
        json={"model": RERANKER, "query": query, "documents": documents},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    scores = [result["relevance_score"] for result in results]
    assert scores == sorted(scores, reverse=True)
    assert sorted(result["index"] for result in results) == [0, 1, 2, 3]
    tokenizer = AutoTokenizer.from_pretrained(str(folders[RERANKER]))
    model = AutoModelForSequenceClassification.from_pretrained(str(folders[RERANKER])).eval()
    features = tokenizer([query] * len(documents), documents, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = torch.sigmoid(model(**features).logits[:, 0]).tolist()
    for result in results:
        assert abs(result["relevance_score"] - expected[result["index"]]) < 1e-4, result
        assert result["document"]["text"] == documents[result["index"]]
    assert max(expected) - min(expected) > 1e-3  # the order checked is not a tie


@pytest.mark.slow  # a second runner (~20 s); the cut itself: worker/tests/test_embedding_batch.py
def test_nomic_matryoshka_dimensions(node: ExoNode, folders: dict[str, Path]) -> None:
    _serve(node, NOMIC)
    reference = _reference_embeddings(folders[NOMIC], TEXTS[:1])[0]
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60)
    full = client.embeddings.create(model=NOMIC, input=TEXTS[0], encoding_format="float")
    assert _cosine(full.data[0].embedding, reference) > 1 - 1e-5
    cut = client.embeddings.create(model=NOMIC, input=TEXTS[0], dimensions=64)
    vector = np.asarray(cut.data[0].embedding)
    assert vector.shape == (64,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    # Matryoshka: the first 64 of the pooled vector, normalized again.
    assert _cosine(vector, reference[:64]) > 1 - 1e-5
    # Ollama's `dimensions` makes the same cut.
    ollama_cut = ollama.Client(host=f"{node.url}/ollama", timeout=60).embed(
        model=NOMIC, input=TEXTS[0], dimensions=64
    )
    assert np.allclose(ollama_cut.embeddings[0], vector, atol=1e-6)
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=NOMIC, input=TEXTS[0], dimensions=32)
    body = raised.value.body
    assert isinstance(body, dict) and body["param"] == "dimensions", body


@pytest.mark.slow  # a second runner (~20 s); the card itself: test_custom_models_routes.py
def test_a_local_bert_folder_added_through_the_api_serves_embeddings(
    node: ExoNode, folders: dict[str, Path]
) -> None:
    """Trial 42: `POST /models/add` refused a local sentence-transformers folder of a BERT
    (400, "no model family file"); added, it is placed and embeds as the catalog's does."""
    directory = str(folders[BERT])
    added = httpx.post(f"{node.url}/models/add", json={"model_id": directory}, timeout=60)
    assert added.status_code == 200, added.text
    assert added.json()["card"]["capabilities"] == ["embedding"]
    _serve(node, directory)
    reference = _reference_embeddings(folders[BERT], TEXTS)
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60)
    answer = client.embeddings.create(model=directory, input=TEXTS, encoding_format="float")
    assert answer.usage.prompt_tokens == 3 + 5 + 4
    for item, expected in zip(answer.data, reference, strict=True):
        assert _cosine(item.embedding, expected) > 1 - 1e-5
