"""OpenAI legacy completions (`POST /v1/completions`) and Ollama raw generate on a live node
with the default model (an instruct model: its prompt is used raw, no chat template),
through the official `openai` and `ollama` clients."""

from __future__ import annotations

from pathlib import Path

import ollama
import openai
import pytest
from transformers import AutoTokenizer

from exo.download.pypi_gguf import model_directory_name
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode

PROMPT = "The capital of France is"


def client_for(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_completion_is_the_raw_prompts_continuation(
    default_node: ExoNode, shared_models_dir: Path
) -> None:
    client = client_for(default_node)
    completion = client.completions.create(
        model=DEFAULT_MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0
    )
    (choice,) = completion.choices
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert choice.text.strip() and choice.finish_reason in ("stop", "length")
    assert completion.usage is not None
    # The prompt's own tokens, no chat template around them.
    tokenizer = AutoTokenizer.from_pretrained(
        shared_models_dir / model_directory_name(DEFAULT_MODEL_ID)
    )
    assert completion.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert 1 <= completion.usage.completion_tokens <= 8

    # Streaming gives the same greedy text, piece by piece, then the usage.
    chunks = list(
        client.completions.create(
            model=DEFAULT_MODEL_ID,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == choice.text
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == choice.finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens

    # echo puts the prompt in front of the same continuation.
    echoed = client.completions.create(
        model=DEFAULT_MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + choice.text


def test_completion_logprobs_and_stop(default_node: ExoNode) -> None:
    client = client_for(default_node)
    completion = client.completions.create(
        model=DEFAULT_MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    assert "".join(logprobs.tokens) == choice.text
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    offsets = [sum(len(token) for token in logprobs.tokens[:index]) for index in range(6)]
    assert logprobs.text_offset == offsets[: len(logprobs.tokens)]
    for token, value, alternatives in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        # Greedy: the sampled token is the likeliest of the alternatives reported with it.
        assert len(alternatives) <= 3 and alternatives[token] == value
        assert value == max(alternatives.values()) and value <= 0.0

    # A stop string ends the text before it (and is not part of it).
    first_word = choice.text.split()[0]
    stopped = client.completions.create(
        model=DEFAULT_MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0, stop=[first_word]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == choice.text[: choice.text.index(first_word)]


def test_refusals_name_the_field(default_node: ExoNode) -> None:
    client = client_for(default_node)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=DEFAULT_MODEL_ID, prompt="def f(", suffix="  return")
    assert caught.value.param == "suffix"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=DEFAULT_MODEL_ID, prompt="x", n=2)
    assert caught.value.param == "n"
    # The prompt's logprobs (echo with logprobs) are not computed; usage options on an
    # answer that does not stream are OpenAI's own 400.
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=DEFAULT_MODEL_ID, prompt="x", echo=True, logprobs=0)
    assert caught.value.param == "echo"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=DEFAULT_MODEL_ID, prompt="x", stream_options={"include_usage": True}
        )
    assert caught.value.param == "stream_options"


def test_ollama_raw_generate_matches_the_completion(default_node: ExoNode) -> None:
    completion = client_for(default_node).completions.create(
        model=DEFAULT_MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0
    )
    client = ollama.Client(host=f"{default_node.url}/ollama", timeout=120)
    generated = client.generate(
        model=DEFAULT_MODEL_ID,
        prompt=PROMPT,
        raw=True,
        options={"temperature": 0, "num_predict": 8},
    )
    assert generated.response == completion.choices[0].text
    assert generated.prompt_eval_count == completion.usage.prompt_tokens  # type: ignore[union-attr]
    # The options listed as no-ops change nothing; sampling exo does not have is a 400.
    no_ops = {
        "temperature": 0, "num_predict": 8, "num_thread": 1, "num_batch": 64,
        "use_mmap": False, "num_keep": 2, "repeat_last_n": -1, "typical_p": 1.0,
        "mirostat": 0, "penalize_newline": True,
    }  # fmt: skip
    again = client.generate(model=DEFAULT_MODEL_ID, prompt=PROMPT, raw=True, options=no_ops)
    assert again.response == generated.response
    with pytest.raises(ollama.ResponseError) as raised:
        client.generate(model=DEFAULT_MODEL_ID, prompt=PROMPT, raw=True, options={"mirostat": 2})
    assert raised.value.status_code == 400 and "options.mirostat" in raised.value.error
