"""A seeded request gives the same tokens whichever path computed its logits: sent cold and
sent again (its prompt a prefix-cache hit, whose last positions are computed with fewer rows
in the step), and alone or batched with others, on the default model (int4 products whose
rounding follows the rows in a call, so the logits move slightly between paths).

The draw is the Gumbel-max race (`decoding/gumbel_race.py`), which changes its token only
where two candidates' perturbed scores lie within the logits' change; the cumulative-sum
draw it replaced gave other text for 6 of these 12 cold / cached pairs.
"""

from __future__ import annotations

from typing import Any

import pytest

from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.engine import GeneratedPiece, TorchEngine
from exo.worker.engines.torch.tests.test_batching import run_batch

PROMPT = "Write a short poem about the sea."
SETTINGS = [(1.0, 1.0), (1.0, 0.9), (0.7, 1.0), (0.7, 0.9)]  # (temperature, top_p)


def request(content: str, **fields: Any) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content=content),), **fields
    )


def tokens(pieces: list[GeneratedPiece]) -> list[int]:
    return [token for piece in pieces for token in piece.token_ids]


@pytest.mark.parametrize(("temperature", "top_p"), SETTINGS)
def test_a_seeded_request_gives_the_same_tokens_cold_and_prefix_cached(
    real_engine: TorchEngine, temperature: float, top_p: float
) -> None:
    for seed in range(3):
        params = request(PROMPT, temperature=temperature, top_p=top_p, seed=seed, max_tokens=24)
        real_engine.clear_prefix_cache()
        cold = list(real_engine.generate(params))
        cached = list(real_engine.generate(params))
        usage = cached[-1].usage
        assert usage is not None and usage.cached_tokens > 0  # the second one hit the cache
        assert cold[-1].usage is not None and cold[-1].usage.cached_tokens == 0
        assert tokens(cached) == tokens(cold), seed


def test_seeded_requests_give_the_same_tokens_batched_as_alone(real_engine: TorchEngine) -> None:
    prompts = [PROMPT, "Tell me about dragons.", "List three fruits.", "Why is the sky blue?"]
    params = [
        request(prompt, temperature=temperature, top_p=top_p, seed=index, max_tokens=16)
        for index, (prompt, (temperature, top_p)) in enumerate(zip(prompts, SETTINGS, strict=True))
    ]
    alone = []
    for one in params:
        real_engine.clear_prefix_cache()
        alone.append(tokens(list(real_engine.generate(one))))
    real_engine.clear_prefix_cache()
    states = [real_engine.build_request(one, request_id=f"r{i}") for i, one in enumerate(params)]
    pieces = run_batch(real_engine, states, join_at=[0, 0, 1, 3])
    real_engine.clear_prefix_cache()
    for index, expected in enumerate(alone):
        assert tokens(pieces[f"r{index}"]) == expected, params[index]
