"""The embeddings and rerank routes over a stand-in cluster: what each dialect sends to the
cluster and how it renders the one chunk back (rerank's sorting, `top_n`,
`return_documents`), and the 400s that need no model: capabilities, `dimensions`, empty
inputs, a chat request to an embedding-only model; the runner's 400 for a request over its
token cap in each dialect."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.chunks import ErrorChunk
from exo.shared.types.commands import ComputeEmbeddings
from exo.shared.types.common import InstanceId, ModelId, NodeId, TaskId
from exo.shared.types.tasks import Embedding
from exo.testing.scripted_cluster import ScriptedCluster
from exo.worker.runner import embedding_batch

EMBEDDER = ModelId("Qwen/Qwen3-Embedding-0.6B")
RERANKER = ModelId("Qwen/Qwen3-Reranker-0.6B")


class EmbeddingCluster(ScriptedCluster):
    """SmolLM2, Qwen3-Embedding-0.6B and Qwen3-Reranker-0.6B placed (answers: the scripted
    cluster's unit vectors and `rerank_scores`)."""

    def __init__(self) -> None:
        super().__init__()
        cards = load_builtin_cards()
        for model in (EMBEDDER, RERANKER):
            self.add_model(cards[model])


def _client(cluster: EmbeddingCluster) -> TestClient:
    return TestClient(create_app(cast(ClusterClient, cluster)))


def test_openai_embeddings_inputs_dimensions_and_base64() -> None:
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        answer = http.post(
            "/v1/embeddings", json={"model": "qwen3-embedding:0.6b", "input": ["a", "b"]}
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert [item["index"] for item in body["data"]] == [0, 1]
        assert body["data"][1]["embedding"] == [0.0, 1.0, 0.0, 0.0]
        assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
        tokens = http.post(
            "/v1/embeddings",
            json={"model": EMBEDDER, "input": [[1, 2], [3]], "dimensions": 64},
        )
        assert tokens.status_code == 200, tokens.text
        assert cluster.embedding_commands[-1].params.inputs == ((1, 2), (3,))
        assert cluster.embedding_commands[-1].params.dimensions == 64
        encoded = http.post(
            "/v1/embeddings",
            json={"model": EMBEDDER, "input": "a", "encoding_format": "base64"},
        )
        assert encoded.json()["data"][0]["embedding"] == "AACAPwAAAAAAAAAAAAAAAA=="
        same = http.post("/ollama/v1/embeddings", json={"model": EMBEDDER, "input": "a"})
        assert same.status_code == 200


def test_openai_embeddings_bad_inputs_are_400s_naming_the_field() -> None:
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        for body, param in [
            ({"model": EMBEDDER, "input": []}, "input"),
            ({"model": EMBEDDER, "input": ""}, "input"),
            ({"model": EMBEDDER, "input": ["a", ""]}, "input"),
            ({"model": EMBEDDER, "input": "a", "dimensions": 16}, "dimensions"),
            ({"model": EMBEDDER, "input": "a", "dimensions": 2048}, "dimensions"),
            ({"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "input": "a", "dimensions": 8},
             "dimensions"),
            ({"model": RERANKER, "input": "a"}, "model"),
            ({"model": EMBEDDER, "input": [[-1]]}, "input"),
            ({"model": EMBEDDER, "input": [[1, 10**9]]}, "input"),
        ]:  # fmt: skip
            answer = http.post("/v1/embeddings", json=body)
            assert answer.status_code == 400, (body, answer.text)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, body
        unknown = http.post("/v1/embeddings", json={"model": "no/such", "input": "a"})
        assert unknown.status_code == 404
    assert cluster.embedding_commands == []


def test_openai_embeddings_input_of_no_known_shape_is_one_clear_400() -> None:
    """An `input` that is none of OpenAI's four shapes is one 400 naming `input` that says
    which shapes it takes (not pydantic's error for every branch of the union), and a
    boolean or float token id is refused, not read as token 1 or 2."""
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        for value in [None, [1.5, 2], ["a", [1, 2]], {"text": "a"}, [True], [[2.0]], 7]:
            answer = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": value})
            assert answer.status_code == 400, (value, answer.text)
            error = answer.json()["error"]
            assert error["param"] == "input", value
            assert error["message"] == (
                "input: it must be a string, an array of strings, an array of token ids "
                "(integers) or an array of such arrays"
            ), value
        assert cluster.embedding_commands == []
        ids = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": [[1, 2], [3]]})
        assert ids.status_code == 200, ids.text
        assert cluster.embedding_commands[-1].params.inputs == ((1, 2), (3,))


def test_ollama_embed_and_legacy_embeddings() -> None:
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        answer = http.post(
            "/api/embed", json={"model": EMBEDDER, "input": ["a", "b", "c"], "keep_alive": "5m"}
        )
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["embeddings"]) == 3
        assert answer.json()["prompt_eval_count"] == 7
        params = cluster.embedding_commands[-1].params
        assert params.truncate is True  # Ollama's default
        assert cluster.embedding_commands[-1].keep_alive is not None
        http.post("/ollama/api/embed", json={"model": EMBEDDER, "input": "a", "truncate": False})
        assert cluster.embedding_commands[-1].params.truncate is False
        legacy = http.post("/api/embeddings", json={"model": EMBEDDER, "prompt": "a"})
        assert legacy.json() == {"embedding": [1.0, 0.0, 0.0, 0.0]}
        commands = len(cluster.embedding_commands)
        no_inputs: list[dict[str, Any]] = [{}, {"input": ""}, {"input": []}]
        for no_input in no_inputs:  # Ollama: a load request
            absent = http.post("/api/embed", json={"model": EMBEDDER, **no_input})
            assert absent.status_code == 200, absent.text
            assert absent.json()["embeddings"] == [], no_input
        assert len(cluster.embedding_commands) == commands
        refused = http.post("/api/embed", json={"model": RERANKER, "input": "a"})
        assert refused.status_code == 400
        assert "embedding" in refused.json()["error"] and set(refused.json()) == {"error"}


def test_ollama_embed_dimensions_reach_the_runner_where_the_model_cuts() -> None:
    """Ollama's `dimensions` on a Matryoshka model (Qwen3-Embedding: 32..1024) is the cut
    the runner makes (the cut itself: worker/tests/test_embedding_batch.py; through a node:
    test_api_encoder_embeddings.py, slow); a width the model has not is a 400 naming it."""
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        for route in ("/api/embed", "/ollama/api/embed"):
            answer = http.post(route, json={"model": EMBEDDER, "input": "a", "dimensions": 64})
            assert answer.status_code == 200, answer.text
            assert cluster.embedding_commands[-1].params.dimensions == 64
        refused = http.post("/api/embed", json={"model": EMBEDDER, "input": "a", "dimensions": 16})
        assert refused.status_code == 400 and "dimensions" in refused.json()["error"]


@pytest.mark.parametrize("inputs", [[""], ["", ""], ["a", "", "b"]])
def test_ollama_embed_answers_one_embedding_per_listed_input_empty_ones_too(
    inputs: list[str],
) -> None:
    """Ollama embeds every entry of a list, an empty string too (only a bare `""` is a load
    request): clients pair `embeddings[i]` with `input[i]`."""
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        answer = http.post("/api/embed", json={"model": EMBEDDER, "input": inputs})
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["embeddings"]) == len(inputs)
    assert cluster.embedding_commands[-1].params.inputs == tuple(inputs)


def test_openai_embeddings_refuse_an_empty_string_in_a_list() -> None:
    """OpenAI answers `[""]` (and any list holding `""`) with 400 "'$.input' is invalid"."""
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        answer = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": [""]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["message"].startswith("'$.input' is invalid")
    assert cluster.embedding_commands == []


def test_rerank_sorts_keeps_indices_and_cuts_to_top_n() -> None:
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            answer = http.post(
                path,
                json={
                    "model": RERANKER, "query": "q",
                    "documents": ["low", {"text": "high"}, "mid"], "top_n": 2,
                },
            )  # fmt: skip
            assert answer.status_code == 200, answer.text
            results = answer.json()["results"]
            assert [result["index"] for result in results] == [1, 2]
            assert [result["relevance_score"] for result in results] == [0.9, 0.5]
            assert results[0]["document"] == {"text": "high"}
        params = cluster.embedding_commands[-1].params
        assert params.kind == "rerank" and params.query == "q"
        assert params.inputs == ("low", "high", "mid")
        bare = http.post(
            "/v1/rerank",
            json={"model": RERANKER, "query": "q", "documents": ["a", "b", "c"],
                  "return_documents": False},
        )  # fmt: skip
        # Left out, as Jina and Cohere answer (it was null until trial 40 saw it).
        assert all(set(result) == {"index", "relevance_score"} for result in bare.json()["results"])
        not_reranker = http.post(
            "/v1/rerank", json={"model": EMBEDDER, "query": "q", "documents": ["a"]}
        )
        assert not_reranker.status_code == 400
        assert "rerank" in not_reranker.json()["error"]["message"]
        empty = http.post("/v1/rerank", json={"model": RERANKER, "query": "q", "documents": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"


def test_chat_to_an_embedding_only_model_is_a_400_naming_the_capability() -> None:
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        chat = http.post(
            "/v1/chat/completions",
            json={"model": EMBEDDER, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 400
        assert '"text" capability' in chat.json()["error"]["message"]
        assert chat.json()["error"]["param"] == "model"
        ollama = http.post("/api/generate", json={"model": EMBEDDER, "prompt": "hi"})
        assert ollama.status_code == 400 and "capability" in ollama.json()["error"]
        listed = {
            item["id"]: item["capabilities"] for item in http.get("/v1/models").json()["data"]
        }
        assert listed[EMBEDDER] == ["embedding"] and listed[RERANKER] == ["rerank"]
        tags = {
            item["name"]: item["capabilities"] for item in http.get("/api/tags").json()["models"]
        }
        assert tags[EMBEDDER] == ["embedding"]
        assert "completion" in tags["HuggingFaceTB/SmolLM2-135M-Instruct"]
        shown = http.post("/api/show", json={"model": EMBEDDER}).json()
        assert shown["capabilities"] == ["embedding"]
    assert cluster.submitted == []


def test_a_model_that_failed_to_prepare_for_good_is_a_500_else_a_503() -> None:
    """As for generations: a permanent preparation failure (a GGUF that cannot be
    converted) is not worth retrying (500), a passing one is (503)."""
    from exo.api.serving.cluster_client import CommandRejectedError
    from exo.shared.types.commands import GenerateText

    class Refusing(EmbeddingCluster):
        status = 500

        async def submit(
            self, command: GenerateText | ComputeEmbeddings, timeout: float = 0.0
        ) -> None:
            raise CommandRejectedError("could not prepare the model", self.status)

    for status, expected in ((500, 500), (503, 503)):
        cluster = Refusing()
        cluster.status = status
        with _client(cluster) as http:
            answer = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": "a"})
        assert answer.status_code == expected, answer.text
        assert "could not prepare" in answer.json()["error"]["message"]


class CharacterBackend:
    """An embedding backend with one token per character, for the runner's own checks."""

    dimensions = 4
    matryoshka_dimensions = None

    def __init__(self, max_input_tokens: int) -> None:
        self.max_input_tokens = max_input_tokens

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [[ord(character) for character in text] for text in texts]

    def scratch_bytes(self, tokens: int) -> int:
        return 0

    def start_embedding(self, token_ids: list[list[int]]) -> None:
        raise AssertionError("a refused request starts no work")

    def start_scoring(self, pairs: list[tuple[str, str]]) -> Any:
        return SimpleNamespace(rows=len(pairs), tokens=sum(len(q + d) for q, d in pairs))


class RefusingCluster(EmbeddingCluster):
    """Answers each embedding command with the runner's refusal (`EmbeddingJob` over a
    `CharacterBackend`)."""

    def __init__(self, max_input_tokens: int = 100) -> None:
        super().__init__()
        self.max_input_tokens = max_input_tokens

    def _embedding_answer(self, command: ComputeEmbeddings) -> Any:
        task = Embedding(
            task_id=TaskId("t"), command_id=command.command_id, instance_id=InstanceId("i"),
            origin_node_id=NodeId("n"), params=command.params,
        )  # fmt: skip
        backend = CharacterBackend(self.max_input_tokens)
        job = embedding_batch.EmbeddingJob(cast(Any, backend), [task])
        ((_, answer),) = job.take_answers()
        assert isinstance(answer, ErrorChunk)
        return answer


def test_a_request_over_the_runners_token_cap_is_a_400_in_each_dialect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runner's refusal (`embedding_batch.MAX_REQUEST_TOKENS`, here 20 tokens, one per
    character) reaches each dialect as its 400 naming the field: OpenAI's envelope with
    `param` `input` and code `max_tokens_per_request`, Ollama's `{"error": ...}`, rerank's
    `param` `documents`."""
    monkeypatch.setattr(embedding_batch, "MAX_REQUEST_TOKENS", 20)

    with _client(RefusingCluster()) as http:
        openai = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": ["a" * 15, "b" * 6]})
        assert openai.status_code == 400, openai.text
        error = openai.json()["error"]
        assert error["param"] == "input" and error["code"] == "max_tokens_per_request"
        assert error["type"] == "invalid_request_error"
        assert error["message"] == (
            "'$.input' is too long: requested 21 tokens, max 20 tokens per request"
        )
        ollama = http.post("/api/embed", json={"model": EMBEDDER, "input": ["a" * 21]})
        assert ollama.status_code == 400, ollama.text
        assert set(ollama.json()) == {"error"} and "'$.input' is too long" in ollama.json()["error"]
        rerank = http.post(
            "/v1/rerank", json={"model": RERANKER, "query": "q", "documents": ["a" * 10] * 2}
        )
        assert rerank.status_code == 400, rerank.text
        assert rerank.json()["error"]["param"] == "documents"
        assert rerank.json()["error"]["code"] == "max_tokens_per_request"
        assert "requested 22 tokens" in rerank.json()["error"]["message"]


def test_an_input_over_the_context_is_worded_as_openai_words_it_for_embeddings() -> None:
    """OpenAI's embeddings sentence, naming the input and its tokens (was the chat sentence,
    "your messages resulted in 12 tokens"); Ollama's `/api/embed` keeps Ollama's."""
    with _client(RefusingCluster(max_input_tokens=10)) as http:
        openai = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": ["ab", "c" * 12]})
        assert openai.status_code == 400, openai.text
        error = openai.json()["error"]
        assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
        assert error["message"] == (
            "Invalid 'input': maximum context length is 10 tokens. input[1] is 12 tokens."
        )
        ollama = http.post(
            "/api/embed", json={"model": EMBEDDER, "input": ["c" * 12], "truncate": False}
        )
        assert ollama.status_code == 400, ollama.text
        assert ollama.json() == {
            "error": "the input length exceeds the context length (12 tokens > 10)"
        }


def test_embeddings_on_a_split_instance_blame_the_model_not_the_input() -> None:
    """A split instance's runner refuses embeddings (pooling needs the whole model on one
    rank): the 400 names `model`, whose placement is at fault (was: `input`), and says
    what to do, in the OpenAI and Ollama shapes."""
    from exo.worker.runner.embedding_turns import EmbeddingTurns
    from exo.worker.runner.messages import ChunkReport, RunnerOutbound

    refusal = (
        f"embeddings and rerank need {EMBEDDER} placed whole on one node; this instance is "
        "split across nodes: place one on a single node (POST /place_instance ...)"
    )

    class SplitEngine:
        def embedding_backend(self) -> Any:
            raise ValueError(refusal)  # as `TorchEngine.embedding_backend` on a split rank

    class SplitCluster(EmbeddingCluster):
        def _embedding_answer(self, command: ComputeEmbeddings) -> Any:
            sent: list[RunnerOutbound] = []
            turns = EmbeddingTurns(sent.append)
            turns.waiting.append(
                Embedding(
                    task_id=TaskId("t"), command_id=command.command_id,
                    instance_id=InstanceId("i"), origin_node_id=NodeId("n"),
                    params=command.params,
                )
            )  # fmt: skip
            turns.take(cast(Any, SplitEngine()))
            (answer,) = [message.chunk for message in sent if isinstance(message, ChunkReport)]
            return answer

    with _client(SplitCluster()) as http:
        openai = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": "a"})
        assert openai.status_code == 400, openai.text
        error = openai.json()["error"]
        assert (error["param"], error["message"]) == ("model", refusal)
        ollama = http.post("/api/embed", json={"model": EMBEDDER, "input": "a"})
        assert (ollama.status_code, ollama.json()) == (400, {"error": refusal})


def test_openai_embeddings_refuse_more_than_2048_inputs_as_openai_does() -> None:
    """OpenAI caps one request at 2048 inputs (a 400 on `input`, before any work; 5,000
    inputs used to be accepted and took 98 s). A single token array longer than 2048 is
    one input."""
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        many = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": ["a"] * 2049})
        assert many.status_code == 400, many.text
        error = many.json()["error"]
        assert error["param"] == "input"
        assert error["message"].startswith(
            "'$.input' is invalid: array length must be 2048 or less, got 2049"
        )
        assert not cluster.embedding_commands
        tokens = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": [1] * 3000})
        assert tokens.status_code == 200, tokens.text


def test_ollama_embed_of_an_unknown_model_says_what_ollama_says() -> None:
    """Ollama's words, as `/api/chat` answers them ("model 'x' not found"); the OpenAI
    route under the Ollama prefix keeps OpenAI's."""
    cluster = EmbeddingCluster()
    with _client(cluster) as http:
        for path, body in [
            ("/ollama/api/embed", {"model": "nope", "input": "a"}),
            ("/ollama/api/embeddings", {"model": "nope", "prompt": "a"}),
        ]:
            answer = http.post(path, json=body)
            assert answer.status_code == 404, answer.text
            assert answer.json() == {"error": "model 'nope' not found"}, path
        openai_shaped = http.post("/ollama/v1/embeddings", json={"model": "nope", "input": "a"})
        assert openai_shaped.json()["error"]["message"] == "The model 'nope' does not exist"
