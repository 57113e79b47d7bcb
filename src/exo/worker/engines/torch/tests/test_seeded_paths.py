"""A seeded request gives the same tokens whichever path computed its logits: sent cold and
sent again (its prompt a prefix-cache hit, whose last token is computed alone), and alone or
batched with others.

The draw is the Gumbel-max race (`decoding/gumbel_race.py`), which changes its token only
where two candidates' perturbed scores lie within the logits' change between the paths.
- Cold against cached is asserted bit for bit on the default model: the prompt's last token
  left alone after a hit is prefilled as a one-row prompt chunk (not a decode step), prompt
  rows take the integer GEMM at any row count (`quantized_linear.PROMPT_PRODUCT`), and each
  prompt chunk's last row attends by exo's row kernel (`batch_attention.
  last_row_attention`), so the first token's logits, and with them every logprob and token,
  are the same bits. Before (2026-12-07, 24 tokens, 20 seeds at each of the four settings
  below), 11 of 80 seeded pairs differed, first-token logprobs by up to ~2e-2; after, none.
  A hit that leaves several prompt tokens still computes them in other chunks than the
  cold prefill did, whose rows torch's flash attention gives other bits (docs/api.md).
- On a float32 model (torch's kernels, float32 rounding apart) the tokens are asserted.
- Batched against alone is asserted on the default model: its decode rows are the same bits
  whatever the step's row count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from exo.shared.types.chunks import TokenLogprob
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.engine import GeneratedPiece, TorchEngine
from exo.worker.engines.torch.tests.test_batching import run_batch, tiny_llama

PROMPT = "Write a short poem about the sea."
SETTINGS = [(1.0, 1.0), (1.0, 0.9), (0.7, 1.0), (0.7, 0.9)]  # (temperature, top_p)


def request(content: str, **fields: Any) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content=content),), **fields
    )


def tokens(pieces: list[GeneratedPiece]) -> list[int]:
    return [token for piece in pieces for token in piece.token_ids]


def logprobs(pieces: list[GeneratedPiece]) -> list[TokenLogprob]:
    return [entry for piece in pieces for entry in piece.logprobs]


@pytest.mark.parametrize(("temperature", "top_p"), SETTINGS)
def test_a_seeded_request_gives_the_same_text_and_logprobs_cold_and_prefix_cached(
    real_engine: TorchEngine, temperature: float, top_p: float
) -> None:
    for seed in range(3):
        params = request(
            PROMPT, temperature=temperature, top_p=top_p, seed=seed, max_tokens=16,
            logprobs=True, top_logprobs=5,
        )  # fmt: skip
        real_engine.clear_prefix_cache()
        cold = list(real_engine.generate(params))
        cached = list(real_engine.generate(params))
        usage, cold_usage = cached[-1].usage, cold[-1].usage
        assert cold_usage is not None and cold_usage.cached_tokens == 0
        # The whole prompt but its last token came from the cache.
        assert usage is not None and usage.cached_tokens == usage.prompt_tokens - 1
        assert tokens(cached) == tokens(cold), seed
        assert logprobs(cached) == logprobs(cold), seed  # exactly: the same logits
    real_engine.clear_prefix_cache()


@pytest.mark.parametrize(("temperature", "top_p"), SETTINGS)
def test_a_seeded_request_gives_the_same_tokens_cold_and_prefix_cached(
    tiny_card: Any, tiny_model_dir: Path, temperature: float, top_p: float
) -> None:
    engine = tiny_llama(tiny_card, tiny_model_dir)  # float32 weights and activations
    for seed in range(6):
        params = request(PROMPT, temperature=temperature, top_p=top_p, seed=seed, max_tokens=24)
        engine.clear_prefix_cache()
        cold = list(engine.generate(params))
        cached = list(engine.generate(params))
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
