"""OpenAI legacy Completions (`POST /v1/completions`) and base models: the adapter, the output
rendering, and the real app over a scripted cluster with the official `openai` client;
chat endpoints refusing a base model in every dialect; Ollama's raw generate."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import anyio
import httpx
import openai
import pytest
import uvicorn
from pydantic import ValidationError

from exo.api.app import create_app
from exo.api.openai_completions.request import to_task_params
from exo.api.openai_completions.response import (
    collect_completion,
    legacy_logprobs,
    stream_completion,
)
from exo.api.openai_completions.wire_types import Completion, CompletionRequest
from exo.api.serving.cluster_client import ClusterClient
from exo.api.wire.errors import GenerationError, InvalidRequestError
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    FinishReason,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.testing.chunks import ChunkSource
from exo.testing.scripted_cluster import ScriptedCluster

GEMMA = ModelId("google/gemma-3-270m")
COMMAND = CommandId("command-1")


def request(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": SMOLLM2, "prompt": "Once", **fields})


def token(text: str, *token_ids: int, logprobs: Sequence[TokenLogprob] = ()) -> TokenChunk:
    return TokenChunk(
        command_id=COMMAND,
        model=SMOLLM2,
        text=text,
        token_ids=token_ids or (1,),
        logprobs=tuple(logprobs),
    )


def finish(
    text: str = "",
    reason: FinishReason = "stop",
    prompt_tokens: int = 4,
    completion_tokens: int = 3,
) -> TokenChunk:
    return TokenChunk(
        command_id=COMMAND,
        model=SMOLLM2,
        text=text,
        finish_reason=reason,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
    )


def logprob(text: str, value: float, *alternatives: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(
        token=text,
        token_id=1,
        logprob=value,
        top_logprobs=tuple(
            TopLogprob(token=alt, token_id=index + 2, logprob=alt_value)
            for index, (alt, alt_value) in enumerate(alternatives)
        ),
    )


# ---------------------------------------------------------------- request conversion


def test_a_prompt_becomes_a_raw_request_with_openai_defaults() -> None:
    params = to_task_params(request(prompt="The capital of France is"))
    assert params.prompt == "The capital of France is" and params.messages == ()
    # OpenAI's documented default for this endpoint.
    assert params.max_tokens == 16
    assert (params.temperature, params.top_p, params.seed) == (None, None, None)
    assert (params.logprobs, params.top_logprobs, params.stream) == (False, 0, False)


def test_sampling_fields_reach_the_request() -> None:
    params = to_task_params(
        request(
            prompt=["one prompt in a list"],
            max_tokens=None,
            temperature=0.0,
            top_p=0.5,
            top_k=-1,
            seed=7,
            stop=["\n", ""],
            stream=True,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            repetition_penalty=1.1,
            logprobs=2,
        )
    )
    assert params.prompt == "one prompt in a list"
    assert params.max_tokens is None  # an explicit null: until a stop or the context end
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.0, 0.5, 0, 7)
    assert params.stop == ("\n",) and params.stream is True
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, 0.25)
    assert params.repetition_penalty == 1.1
    assert (params.logprobs, params.top_logprobs) == (True, 2)
    # logprobs=0: the sampled tokens' log probabilities, no alternatives.
    assert (to_task_params(request(logprobs=0)).logprobs, request(logprobs=0).logprobs) == (True, 0)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"suffix": "tail"}, "suffix", "suffix"),
        ({"n": 2}, "n", "n=2 is not supported"),
        ({"best_of": 3}, "best_of", "best_of=3 is not supported"),
        ({"prompt": ["a", "b"]}, "prompt", "a batch of 2 prompts"),
        ({"prompt": []}, "prompt", "empty list"),
        ({"prompt": [1, 2, 3]}, "prompt", "token ids"),
        ({"prompt": [[1, 2], [3]]}, "prompt", "token ids"),
        ({"echo": True, "logprobs": 1}, "echo", "echo together with logprobs"),
        ({"logit_bias": {"Paris": 1.0}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias", "logit_bias"),
    ],
)
def test_what_exo_does_not_do_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(InvalidRequestError, match=says) as caught:
        to_task_params(request(**fields))
    assert caught.value.param == param and caught.value.status_code == 400


def test_logit_bias_reaches_the_params() -> None:
    assert to_task_params(request(logit_bias={"7042": -100})).logit_bias == {7042: -100.0}


def test_neutral_values_of_refused_fields_are_accepted() -> None:
    params = to_task_params(request(suffix="", n=1, best_of=1, logit_bias={}, echo=True))
    assert params.prompt == "Once"


@pytest.mark.parametrize(
    "fields",
    [{"max_tokens": 0}, {"logprobs": 21}, {"temperature": 2.5}, {"prompt": None}, {"model": ""}],
)
def test_out_of_range_values_are_schema_errors(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        request(**fields)


# ---------------------------------------------------------------- output


def collect(chunks: Sequence[Chunk], echo: str = "", **fields: Any) -> Completion:
    params = to_task_params(request(**fields))

    async def run() -> Completion:
        return await collect_completion(
            ChunkSource(chunks),
            completion_id="cmpl-1",
            model=SMOLLM2,
            created=1,
            params=params,
            echo=echo,
        )

    return anyio.run(run)


def stream(
    chunks: Sequence[Chunk], include_usage: bool = False, echo: str = "", **fields: Any
) -> list[dict[str, Any] | str]:
    """The SSE events, each `data:` payload parsed (`[DONE]` kept as the string)."""
    params = to_task_params(request(**fields))

    async def run() -> list[str]:
        return [
            event
            async for event in stream_completion(
                ChunkSource(chunks),
                completion_id="cmpl-1",
                model=SMOLLM2,
                created=1,
                include_usage=include_usage,
                params=params,
                echo=echo,
            )
        ]

    events: list[dict[str, Any] | str] = []
    for event in anyio.run(run):
        assert event.startswith("data: ") and event.endswith("\n\n")
        payload = event.removeprefix("data: ").strip()
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_a_whole_completion() -> None:
    completion = collect([token(" Par"), token("is"), finish(".", "length", 6, 3)])
    assert completion.object == "text_completion" and completion.id == "cmpl-1"
    (choice,) = completion.choices
    assert (choice.text, choice.finish_reason, choice.index) == (" Paris.", "length", 0)
    assert choice.logprobs is None
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.total_tokens) == (6, 9)


def test_echo_puts_the_prompt_before_the_completion() -> None:
    assert collect([token(" Paris"), finish()], echo="Capital:").choices[0].text == (
        "Capital: Paris"
    )
    events = stream([token(" Paris"), finish()], echo="Capital:")
    texts = [event["choices"][0]["text"] for event in events if isinstance(event, dict)]
    assert texts == ["Capital:", " Paris", ""]


def test_legacy_logprobs_shape_and_offsets() -> None:
    chunks = [
        token(" Par", 5, logprobs=[logprob(" Par", -0.5, (" Par", -0.5), (" Lon", -1.5))]),
        token("is", 6, logprobs=[logprob("is", -0.1, ("is", -0.1))]),
        finish(),
    ]
    completion = collect(chunks, logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == [" Par", "is"]
    assert logprobs.token_logprobs == [-0.5, -0.1]
    assert logprobs.top_logprobs == [{" Par": -0.5, " Lon": -1.5}, {"is": -0.1}]
    assert logprobs.text_offset == [0, 4]


def test_the_sampled_token_is_always_among_the_top_logprobs() -> None:
    # OpenAI: "up to logprobs+1 elements": a sampled token outside the top n is added.
    logprobs = legacy_logprobs([logprob("b", -2.0, ("a", -0.2))], text_offset=3)
    assert logprobs.top_logprobs == [{"a": -0.2, "b": -2.0}]
    assert logprobs.text_offset == [3]


def test_text_offsets_stay_inside_the_text() -> None:
    """Two byte tokens of one character ("é" is 0xC3 0xA9): alone each decodes to
    "\ufffd", and the detokenizer sends no text until the character is complete. Every
    offset must point into the choice's text (OpenAI: where the token starts in it)."""
    first = logprob("\ufffd", -0.3, ("\ufffd", -0.3), ("a", -2.0))
    second = logprob("\ufffd", -0.2, ("\ufffd", -0.2))
    chunks = [
        token(" caf", 5, logprobs=[logprob(" caf", -0.1)]),
        token("", 6, logprobs=[first]),
        token("é", 7, logprobs=[second]),
        token("!", 8, logprobs=[logprob("!", -0.4)]),
        finish(),
    ]
    completion = collect(chunks, logprobs=1, echo="Q:")
    choice = completion.choices[0]
    assert choice.text == "Q: café!"
    assert choice.logprobs is not None
    assert choice.logprobs.text_offset == [2, 6, 6, 7]  # "é" starts at 6, "!" right after
    assert all(offset <= len(choice.text) for offset in choice.logprobs.text_offset)
    events = stream(chunks, logprobs=1, echo="Q:")
    bodies = [event for event in events if isinstance(event, dict) and event["choices"]]
    offsets = [
        offset
        for body in bodies
        if body["choices"][0]["logprobs"]
        for offset in body["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == choice.logprobs.text_offset
    streamed_text = "".join(body["choices"][0]["text"] for body in bodies)
    assert streamed_text == "Q: café!"
    assert bodies[2]["choices"][0]["logprobs"]["top_logprobs"] == [{"\ufffd": -0.3, "a": -2.0}]


def test_streamed_chunks_usage_and_done() -> None:
    chunks = [token("Hel", logprobs=[logprob("Hel", -1.0)]), token("lo"), finish("!")]
    events = stream(chunks, include_usage=True, logprobs=0)
    assert events[-1] == "[DONE]"
    bodies = [event for event in events[:-1] if isinstance(event, dict)]
    assert all(body["object"] == "text_completion" and body["id"] == "cmpl-1" for body in bodies)
    assert [body["choices"][0]["text"] for body in bodies[:-1]] == ["Hel", "lo", "!", ""]
    assert bodies[0]["choices"][0]["logprobs"]["tokens"] == ["Hel"]
    assert [body["choices"][0]["finish_reason"] for body in bodies[:-1]] == [
        None,
        None,
        None,
        "stop",
    ]
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["total_tokens"] == 7
    assert all(body["usage"] is None for body in bodies[:-1])


def test_a_failure_mid_stream_is_an_error_event_then_done() -> None:
    failed = ErrorChunk(command_id=COMMAND, model=SMOLLM2, error_message="runner crashed")
    events = stream([token("part"), failed])
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert isinstance(error, dict) and error["error"]["message"] == "runner crashed"
    with pytest.raises(GenerationError, match="runner crashed"):
        collect([token("part"), failed])
    with pytest.raises(GenerationError, match="cancelled"):
        collect([token("part"), finish(reason="cancelled")])
    refused = ErrorChunk(
        command_id=COMMAND, model=SMOLLM2, error_message="too long", status_code=400
    )
    with pytest.raises(InvalidRequestError, match="too long") as caught:
        collect([refused])
    assert caught.value.param == "prompt"


def test_a_stream_stops_at_the_finish() -> None:
    source = ChunkSource([finish("x"), token("never read")])

    async def run() -> Completion:
        return await collect_completion(
            source, completion_id="c", model=SMOLLM2, created=1,
            params=to_task_params(request()),
        )  # fmt: skip

    assert anyio.run(run).choices[0].text == "x" and source.taken == 1


# ---------------------------------------------------------------- the app, official client


class BaseModelCluster(ScriptedCluster):
    """SmolLM2 (instruct) and Gemma 3 270M (a base model: no chat template) placed; every
    generation streams `script`."""

    def __init__(self) -> None:
        super().__init__()
        gemma = load_builtin_cards()[GEMMA]
        self.cards[GEMMA] = gemma
        self.state = make_state(
            instances=[
                make_instance(self.node_id),
                make_instance(self.node_id, gemma, instance_id="instance-2"),
            ]
        )
        self.script: list[Chunk] = [token(" Paris"), token(" is"), finish(".")]

    @contextmanager
    def chunk_stream(self, command_id: CommandId) -> Iterator[AsyncIterator[Chunk]]:
        async def chunks() -> AsyncIterator[Chunk]:
            for chunk in self.script:
                yield chunk.model_copy(update={"command_id": command_id})

        yield chunks()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, BaseModelCluster]]:
    cluster = BaseModelCluster()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    app = create_app(cast(ClusterClient, cluster))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}", cluster
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()
        assert not thread.is_alive(), "uvicorn did not stop within 10 s"


@pytest.fixture
def cluster(server: tuple[str, BaseModelCluster]) -> BaseModelCluster:
    server[1].submitted.clear()
    return server[1]


@pytest.fixture
def client(server: tuple[str, BaseModelCluster]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x", timeout=10.0, max_retries=0)


def last_params(cluster: BaseModelCluster) -> TextGenerationTaskParams:
    return cluster.submitted[-1].params


def test_openai_client_completion(client: openai.OpenAI, cluster: BaseModelCluster) -> None:
    completion = client.completions.create(
        model=GEMMA, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.model == GEMMA
    assert completion.choices[0].text == " Paris is."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.total_tokens == 7
    params = last_params(cluster)
    assert params.prompt == "The capital of France is" and params.max_tokens == 5


def test_openai_client_streamed_completion_with_usage(
    client: openai.OpenAI, cluster: BaseModelCluster
) -> None:
    chunks = list(
        client.completions.create(
            model=GEMMA,
            prompt="The capital of France is",
            stream=True,
            stream_options={"include_usage": True},
            echo=True,
        )
    )
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == "The capital of France is Paris is."
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert last_params(cluster).stream is True


def test_openai_client_gets_the_refusals(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="suffix") as caught:
        client.completions.create(model=GEMMA, prompt="def f(", suffix="return 1")
    assert caught.value.param == "suffix"
    # OpenAI's own 400s, with its parameter names: usage options on an unstreamed answer,
    # and the prompt's log probabilities (echo with logprobs), which exo does not compute.
    refused: list[tuple[dict[str, Any], str]] = [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
    ]
    for fields, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=GEMMA, prompt="x", **fields)
        assert caught.value.param == param and caught.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no/such-model", prompt="x")


def test_instruct_models_complete_raw_prompts_too(
    client: openai.OpenAI, cluster: BaseModelCluster
) -> None:
    client.completions.create(model=SMOLLM2, prompt="<|im_start|>user\nHi<|im_end|>\n")
    assert last_params(cluster).prompt == "<|im_start|>user\nHi<|im_end|>\n"


def test_ollama_serves_the_openai_completions_route_too(
    server: tuple[str, BaseModelCluster], cluster: BaseModelCluster
) -> None:
    client = openai.OpenAI(
        base_url=f"{server[0]}/ollama/v1", api_key="x", timeout=10.0, max_retries=0
    )
    assert client.completions.create(model=GEMMA, prompt="x").choices[0].text == " Paris is."
    assert last_params(cluster).prompt == "x"


CHAT_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    "/ollama/api/chat": {"messages": [{"role": "user", "content": "hi"}], "stream": False},
    "/ollama/api/generate": {"prompt": "hi", "stream": False},
}


@pytest.mark.parametrize("path", list(CHAT_BODIES))
def test_every_chat_endpoint_refuses_a_base_model(
    server: tuple[str, BaseModelCluster], cluster: BaseModelCluster, path: str
) -> None:
    response = httpx.post(f"{server[0]}{path}", json={"model": GEMMA, **CHAT_BODIES[path]})
    assert response.status_code == 400, response.text
    body = response.json()
    message = json.dumps(body)
    assert f"'{GEMMA}' is a base model" in message and "/v1/completions" in message
    assert cluster.submitted == []
    # The same request for the instruct model is served.
    served = {**CHAT_BODIES[path], "model": SMOLLM2}
    assert httpx.post(f"{server[0]}{path}", json=served).status_code == 200


def test_counting_a_base_model_conversation_is_refused_too(
    server: tuple[str, BaseModelCluster],
) -> None:
    body = {"model": GEMMA, "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(f"{server[0]}/v1/messages/count_tokens", json=body)
    assert response.status_code == 400
    assert f"'{GEMMA}' is a base model" in response.json()["error"]["message"]


def test_ollama_raw_generate_serves_a_base_model(
    server: tuple[str, BaseModelCluster], cluster: BaseModelCluster
) -> None:
    body = {"model": GEMMA, "prompt": "The capital of France is", "raw": True, "stream": False}
    response = httpx.post(f"{server[0]}/ollama/api/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["response"] == " Paris is."
    params = last_params(cluster)
    assert params.prompt == "The capital of France is" and params.messages == ()


@pytest.mark.parametrize(
    ("extra", "named"), [({"system": "be brief"}, "system"), ({"think": True}, "think")]
)
def test_ollama_raw_generate_refuses_what_needs_a_template(
    server: tuple[str, BaseModelCluster], extra: dict[str, Any], named: str
) -> None:
    body = {"model": GEMMA, "prompt": "x", "raw": True, "stream": False, **extra}
    response = httpx.post(f"{server[0]}/ollama/api/generate", json=body)
    assert response.status_code == 400
    assert response.json()["error"].startswith(f"raw mode does not support {named}")
