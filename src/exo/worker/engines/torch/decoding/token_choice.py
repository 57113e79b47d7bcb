"""How one request chooses its tokens: its penalties, logit bias, constraint (a forced tool
call, a JSON object or schema) and sampler in one `TokenChooser`, and the log probabilities
it reports for the token chosen."""

from __future__ import annotations

import torch

from exo.shared.types.chunks import TokenLogprob, TopLogprob
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.worker.engines.torch.decoding.constraints import (
    TokenConstraint,
    json_object_constraint,
    json_schema_constraint,
    tool_call_constraint,
)
from exo.worker.engines.torch.decoding.logit_adjustments import LogitBias, TokenPenalties
from exo.worker.engines.torch.decoding.sampling import (
    Sampler,
    StepLogprobs,
    TokenChooser,
    step_logprobs,
)
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.decoding.vocabulary import TokenVocabulary


def token_chooser_for(
    params: TextGenerationTaskParams,
    sampling: SamplingParams,
    prompt_ids: list[int],
    vocabulary: TokenVocabulary,
    vocab_size: int,
    eos_token_ids: frozenset[int],
    device: torch.device,
) -> TokenChooser:
    """The request's penalties (seeded with its prompt), logit bias, constraint and sampler.

    Args:
        vocab_size: the length of the model's logits vectors.

    Raises:
        ValueError: a forced tool call without tools to offer; a logit bias for a token id
            outside the vocabulary.
    """
    penalties: TokenPenalties | None = None
    if sampling.has_penalties:
        penalties = TokenPenalties(sampling, vocab_size, device)
        penalties.observe_prompt(prompt_ids)
    bias = LogitBias(params.logit_bias, vocab_size, device) if params.logit_bias else None
    constraint: TokenConstraint | None = None
    if params.forces_tool_call:
        constraint = tool_call_constraint(params.offered_tools, vocabulary, eos_token_ids)
    elif params.response_format == "json_object":
        constraint = json_object_constraint(vocabulary, eos_token_ids)
    elif params.response_format == "json_schema":
        assert params.json_schema is not None  # TextGenerationTaskParams checks it
        constraint = json_schema_constraint(params.json_schema, vocabulary, eos_token_ids)
    return TokenChooser(Sampler(sampling, device), penalties, constraint, bias)


def token_logprob(
    vocabulary: TokenVocabulary, logits: torch.Tensor | StepLogprobs, token_id: int, top_n: int
) -> TokenLogprob:
    """The chosen token's log probability (and the `top_n` likeliest alternatives).

    Args:
        logits: `[vocab]` raw scores of the position (before penalties and filters), or
            their `step_logprobs` computed elsewhere (a pipeline's last rank).
        token_id: the chosen token.
        top_n: alternatives to report (0: none).
    """
    step = logits if isinstance(logits, StepLogprobs) else step_logprobs(logits, token_id, top_n)
    top = tuple(
        TopLogprob(
            token=vocabulary.text(candidate),
            token_id=candidate,
            logprob=logprob,
            bytes=tuple(vocabulary.token_bytes[candidate]),
        )
        for candidate, logprob in zip(step.top_ids, step.top_logprobs, strict=True)
    )
    return TokenLogprob(
        token=vocabulary.text(token_id), token_id=token_id, logprob=step.logprob,
        bytes=tuple(vocabulary.token_bytes[token_id]), top_logprobs=top,
    )  # fmt: skip
