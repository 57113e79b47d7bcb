"""Decisions for every declared field of the OpenAI legacy Completions request model."""

from __future__ import annotations

from exo.api.tests.field_decisions import (
    COMPLETIONS,
    Decision,
    Effect,
    NoOp,
    Refused,
    Shows,
    fields,
    sampling_effects,
)
from exo.testing.builders import SMOLLM2


def completions_effects() -> list[Decision]:
    return [
        Effect(
            fields("CompletionRequest.model"), COMPLETIONS, {}, lambda p: p.model == SMOLLM2, True
        ),
        Effect(
            fields("CompletionRequest.prompt"),
            COMPLETIONS,
            {"prompt": "Once upon"},
            lambda p: p.prompt == "Once upon",
        ),
        Refused(fields("CompletionRequest.suffix"), COMPLETIONS, {"suffix": "end"}, "suffix"),
        Effect(
            fields("CompletionRequest.max_tokens"),
            COMPLETIONS,
            {"max_tokens": 7},
            lambda p: p.max_tokens == 7,
        ),
        *sampling_effects(
            COMPLETIONS,
            "CompletionRequest",
            {
                "temperature": 0.3,
                "top_p": 0.5,
                "top_k": 7,
                "min_p": 0.2,
                "seed": 42,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.25,
                "repetition_penalty": 1.2,
                "speculative": True,
            },
        ),
        Refused(
            fields("CompletionRequest.speculative"),
            COMPLETIONS,
            {"speculative": "sometimes"},
            "speculative",
        ),
        Effect(
            fields("CompletionRequest.stop"),
            COMPLETIONS,
            {"stop": "END"},
            lambda p: p.stop == ("END",),
        ),
        Effect(
            fields("CompletionRequest.stream"), COMPLETIONS, {"stream": True}, lambda p: p.stream
        ),
        Shows(
            fields("CompletionRequest.stream_options"),
            COMPLETIONS,
            {"stream": True, "stream_options": {"include_usage": True}},
            lambda answer: any(
                event.get("usage") and not event.get("choices") for event in answer["events"]
            ),
        ),
        Refused(
            fields("CompletionRequest.stream_options"),
            COMPLETIONS,
            {"stream_options": {"include_usage": True}},
            "stream_options",
        ),
        Refused(
            fields("CompletionRequest.echo", "CompletionRequest.logprobs"),
            COMPLETIONS,
            {"echo": True, "logprobs": 0},
            "echo",
        ),
        Effect(
            fields("CompletionRequest.logprobs"),
            COMPLETIONS,
            {"logprobs": 2},
            lambda p: (p.logprobs, p.top_logprobs) == (True, 2),
        ),
        Shows(
            fields("CompletionRequest.echo"),
            COMPLETIONS,
            {"prompt": "Once", "echo": True},
            lambda answer: answer["json"]["choices"][0]["text"].startswith("Once"),
        ),
        Refused(fields("CompletionRequest.n"), COMPLETIONS, {"n": 2}, "n"),
        Refused(fields("CompletionRequest.best_of"), COMPLETIONS, {"best_of": 2}, "best_of"),
        Effect(
            fields("CompletionRequest.logit_bias"),
            COMPLETIONS,
            {"logit_bias": {"7042": -100}},
            lambda p: p.logit_bias == {7042: -100.0},
        ),
        Refused(
            fields("CompletionRequest.logit_bias"),
            COMPLETIONS,
            {"logit_bias": {"49152": 1}},
            "logit_bias",
        ),
        NoOp(fields("CompletionRequest.user"), COMPLETIONS, {"user": "u-1"}, "`user`"),
    ]
