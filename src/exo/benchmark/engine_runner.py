"""The torch engine measured in-process through `submit` / `step`, the path a runner serves
requests by, with the same prompts, EOS ban and timing rules as the bench's API client (so
API streaming decode can be set against the engine's own)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from exo.benchmark.prompts import EOS_BIAS, ModelText
from exo.benchmark.stats import RequestTiming, RunResult
from exo.shared.models.weight_formats import DEFAULT_PREFILL_ACTIVATIONS, PrefillActivations
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import TextGenerationTaskParams

if TYPE_CHECKING:
    from exo.worker.engines.torch.engine import TorchEngine

# A bound on the steps of one run: prompt chunks plus generated tokens, with room to spare.
MAX_STEPS_PER_TOKEN = 4


class EngineRunError(RuntimeError):
    """A request failed in the engine or did not generate the asked number of tokens."""


def load_engine_for_bench(
    model_dir: Path,
    weight_dtype: str | None = None,
    prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS,
) -> TorchEngine:
    """The whole model of `model_dir` in one single-rank engine, warmed up."""
    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.engine import TorchEngine

    card = card_from_local_directory(model_dir)
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )
    engine = TorchEngine.load(
        model_dir,
        shard,
        weight_dtype=weight_dtype,  # type: ignore[arg-type]
        prefill_activations=prefill_activations,
    )
    engine.warmup()
    return engine


def run_engine(
    engine: TorchEngine, prompts: list[str], generation_tokens: int, model_text: ModelText
) -> RunResult:
    """Submit one greedy request per prompt together and step the engine until all end.

    Times: submission, the step that streamed a request's first piece, its last piece
    (seconds from the run's start). Token counts come from the streamed pieces.

    Raises:
        EngineRunError: a request failed, or one ended before `generation_tokens` tokens
            (EOS not banned).
    """
    bias = {token_id: EOS_BIAS for token_id in model_text.eos_token_ids}
    origin = time.perf_counter()
    submitted: dict[str, float] = {}
    prompt_tokens: dict[str, int] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    finish: dict[str, str] = {}
    for index, prompt in enumerate(prompts):
        params = TextGenerationTaskParams(
            model=ModelId("bench"),
            prompt=prompt,
            max_tokens=generation_tokens,
            temperature=0.0,
            logit_bias=bias,
        )
        request_id = f"bench-{index}"
        submitted[request_id] = time.perf_counter() - origin
        prompt_tokens[request_id] = engine.submit(params, request_id=request_id).prompt_tokens
    budget = MAX_STEPS_PER_TOKEN * (sum(prompt_tokens.values()) + generation_tokens * len(prompts))
    for _ in range(budget):
        if not engine.has_work:
            break
        outputs = engine.step()
        now = time.perf_counter() - origin
        for request_id, piece in outputs:
            if isinstance(piece, Exception):
                raise EngineRunError(f"{request_id} failed: {piece}") from piece
            if piece.token_ids:
                first.setdefault(request_id, now)
                last[request_id] = now
                counts[request_id] = counts.get(request_id, 0) + len(piece.token_ids)
            if piece.finish_reason is not None:
                finish[request_id] = str(piece.finish_reason)
    else:
        raise EngineRunError(f"the engine still had work after {budget} steps")
    engine.store_finished()  # as a runner does once the last pieces are out
    timings = []
    for request_id in submitted:
        if counts.get(request_id) != generation_tokens:
            raise EngineRunError(
                f"{request_id}: asked for {generation_tokens} tokens, got "
                f"{counts.get(request_id, 0)} (finish {finish.get(request_id)})"
            )
        timings.append(
            RequestTiming(
                prompt_tokens=prompt_tokens[request_id],
                completion_tokens=counts[request_id],
                submitted_s=submitted[request_id],
                first_token_s=first[request_id],
                last_token_s=last[request_id],
                finish_reason=finish.get(request_id),
            )
        )
    return RunResult(requests=timings)
