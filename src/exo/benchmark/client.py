"""The bench's HTTP client: streamed `/v1/completions` requests, timed as they arrive.

Raw completions are used (not chat) so a prompt's length in tokens is what the bench made
it, with no chat template around it; every model serves them ("Base models and raw
prompts" in docs/compatibility.md).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from exo.benchmark.stats import RequestTiming, RunResult

REQUEST_TIMEOUT_SECONDS = 600.0


class BenchRequestError(RuntimeError):
    """A request failed or did not generate exactly the asked number of tokens."""


@dataclass(frozen=True)
class ApiTarget:
    """Where the bench sends its requests."""

    url: str
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def request_headers(self) -> dict[str, str]:
        if self.api_key is None:
            return dict(self.headers)
        return {**self.headers, "authorization": f"Bearer {self.api_key}"}


def stream_completion(
    target: ApiTarget,
    model: str,
    prompt: str,
    max_tokens: int,
    logit_bias: dict[str, float],
    origin: float,
) -> RequestTiming:
    """One greedy streamed completion; times are `time.perf_counter()` minus `origin`.

    Raises:
        BenchRequestError: an HTTP error, an error event in the stream, or a generation
            that did not end by length with `max_tokens` tokens (EOS not banned?).
    """
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": logit_bias,
    }
    # The client is built before the clock starts: building one loads the TLS
    # certificates (10-40 ms on the 2-core machine, measured), the bench's own cost, which
    # was counted in every TTFT (and prefill tok/s) of the API until then.
    client = httpx.Client(timeout=REQUEST_TIMEOUT_SECONDS)
    submitted = time.perf_counter() - origin
    first: float | None = None
    last = submitted
    usage: dict[str, int] | None = None
    finish_reason: str | None = None
    with (
        client,
        client.stream(
            "POST", f"{target.url}/v1/completions", json=body, headers=target.request_headers()
        ) as response,
    ):
        if response.status_code != 200:
            raise BenchRequestError(f"HTTP {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise BenchRequestError(f"error event: {event['error']}")
            now = time.perf_counter() - origin
            for choice in event.get("choices", []):
                if choice.get("text"):
                    first = now if first is None else first
                    last = now
                finish_reason = choice.get("finish_reason") or finish_reason
            if event.get("usage"):
                usage = event["usage"]
    if usage is None or first is None:
        raise BenchRequestError("the stream ended without tokens or usage")
    if usage["completion_tokens"] != max_tokens or finish_reason != "length":
        raise BenchRequestError(
            f"asked for {max_tokens} tokens, got {usage['completion_tokens']} "
            f"(finish_reason {finish_reason}): EOS was not banned"
        )
    return RequestTiming(
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        submitted_s=submitted,
        first_token_s=first,
        last_token_s=last,
        finish_reason=finish_reason,
    )


def run_concurrent(
    target: ApiTarget,
    model: str,
    prompts: list[str],
    max_tokens: int,
    logit_bias: dict[str, float],
) -> RunResult:
    """Submit one request per prompt at once (one thread each) and wait for all.

    Raises:
        BenchRequestError: any request failed (the first failure).
    """
    origin = time.perf_counter()
    results: list[RequestTiming | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            results[index] = stream_completion(
                target, model, prompts[index], max_tokens, logit_bias, origin
            )
        except BaseException as error:  # reported by the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_SECONDS + 10)
    if errors:
        raise BenchRequestError(str(errors[0])) from errors[0]
    if any(result is None for result in results):
        raise BenchRequestError("a request did not finish in time")
    return RunResult(requests=[result for result in results if result is not None])
