"""Bytes from the first second on a live node: three streamed requests (Chat Completions,
Responses, Claude Messages) whose prompts the runner prefills slowly (the engine's test
seam: every prefill step takes `PREFILL_STEP_SECONDS`) are read by the official SDKs, which
parse the heartbeats the node sends before the first token (SSE comments; Claude `ping`
events) without error and get the answer. The raw bytes each SDK received are recorded by
its HTTP client's transport, to see the heartbeats were there.

The first token of each comes at least one prefill step after its request, and the node's
first heartbeat `HEADERS_AFTER_SECONDS + KEEPALIVE_SECONDS` (6 s) after it: a step of 9 s
leaves every stream a heartbeat with 3 s to spare, however the three share the steps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anthropic
import httpx
import httpx2
import openai
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import WhitespaceSplit

from exo.api.serving.early_stream import HEADERS_AFTER_SECONDS, KEEPALIVE_SECONDS
from exo.testing.processes import ExoNode
from exo.testing.seam import mark_model_dir
from exo.testing.tiny_models import save_tiny_checkout

PREFILL_STEP_SECONDS = 9.0
REPLY = "w1 w2 w3"
# The messages' words only: no thinking section (whose text would be reasoning, not answer).
PLAIN_TEMPLATE = "{% for message in messages %}{{ message.content }} {% endfor %}"
PROMPT_WORDS = 200
READY_TIMEOUT_SECONDS = 120.0
REQUEST_TIMEOUT_SECONDS = 120.0
assert PREFILL_STEP_SECONDS > HEADERS_AFTER_SECONDS + KEEPALIVE_SECONDS + 2


def recording_client(http: ModuleType, received: bytearray) -> Any:
    """An `http.Client` (`http`: httpx for the openai SDK, httpx2 for anthropic's) whose
    transport keeps every byte of the response bodies it reads in `received`."""

    class RecordedStream(http.SyncByteStream):  # type: ignore[misc, name-defined]
        def __init__(self, stream: Any) -> None:
            self._stream = stream

        def __iter__(self) -> Iterator[bytes]:
            for part in self._stream:
                received.extend(part)
                yield part

        def close(self) -> None:
            self._stream.close()

    class RecordingTransport(http.HTTPTransport):  # type: ignore[misc, name-defined]
        def handle_request(self, request: Any) -> Any:
            response = super().handle_request(request)
            response.stream = RecordedStream(response.stream)
            return response

    return http.Client(transport=RecordingTransport(), timeout=REQUEST_TIMEOUT_SECONDS)


def test_slow_prefills_stream_heartbeats_the_official_sdks_parse(tmp_path: Path) -> None:
    model_dir = save_tiny_checkout(tmp_path / "slow-prefill", chat_template=PLAIN_TEMPLATE)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.pre_tokenizer = WhitespaceSplit()  # one token per word of the prompt
    tokenizer.save(str(model_dir / "tokenizer.json"))
    # The answer is scripted (the seam forces its tokens): three words of the vocabulary.
    mark_model_dir(model_dir, prefill_chunk_seconds=PREFILL_STEP_SECONDS, replies=[("w0", REPLY)])
    prompt = " ".join(f"w{i % 61}" for i in range(PROMPT_WORDS))
    node = ExoNode(tmp_path / "node", extra_args=("--no-default-model",))
    try:
        node.launch()
        node.wait_api()
        model_id, _runner_id = node.serve_local_model(model_dir, timeout=READY_TIMEOUT_SECONDS)
        received = {dialect: bytearray() for dialect in ("chat", "responses", "claude")}
        answers: dict[str, str] = {}
        errors: dict[str, BaseException] = {}

        def client(dialect: str) -> Any:
            return recording_client(httpx2 if dialect == "claude" else httpx, received[dialect])

        def chat() -> str:
            sdk = openai.OpenAI(
                base_url=f"{node.url}/v1", api_key="x", max_retries=0, http_client=client("chat")
            )
            stream = sdk.chat.completions.create(
                model=model_id,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=8,
                stream=True,
            )
            return "".join(
                event.choices[0].delta.content or "" for event in stream if event.choices
            )

        def responses() -> str:
            sdk = openai.OpenAI(
                base_url=f"{node.url}/v1",
                api_key="x",
                max_retries=0,
                http_client=client("responses"),
            )
            events = list(
                sdk.responses.create(
                    model=model_id, input=prompt, max_output_tokens=16, stream=True
                )
            )
            assert events[0].type == "response.created", events[0]
            final = events[-1]
            assert final.type in ("response.completed", "response.incomplete"), final
            return final.response.output_text

        def claude() -> str:
            sdk = anthropic.Anthropic(
                base_url=node.url, api_key="x", max_retries=0, http_client=client("claude")
            )
            with sdk.messages.stream(
                model=model_id, max_tokens=8, messages=[{"role": "user", "content": prompt}]
            ) as stream:
                message = stream.get_final_message()
            assert message.usage.input_tokens >= PROMPT_WORDS
            return "".join(block.text for block in message.content if block.type == "text")

        def run(dialect: str, call: object) -> None:
            try:
                answers[dialect] = call()  # type: ignore[operator]
            except BaseException as error:
                errors[dialect] = error

        threads = [
            threading.Thread(target=run, args=(name, call))
            for name, call in (("chat", chat), ("responses", responses), ("claude", claude))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=REQUEST_TIMEOUT_SECONDS + 10)
        assert not any(thread.is_alive() for thread in threads), "a request never ended"
        assert not errors, errors
        assert set(answers) == {"chat", "responses", "claude"}
        assert all(answer.split() == REPLY.split() for answer in answers.values()), answers
        assert b"\n: keep-alive\n" in b"\n" + bytes(received["chat"])
        assert b"\n: keep-alive\n" in b"\n" + bytes(received["responses"])
        assert b"event: ping\n" in bytes(received["claude"])
    finally:
        node.stop()
