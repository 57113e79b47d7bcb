"""TTFT and decode speed with and without the exact prefix-hit path, interleaved in one
process on the default model (docs/benchmarks/2026-12-07-seeded-prefix-cache.md).

Usage: PYTHONPATH=src python bench/bench_prefix_hit_paths.py [--runs 9]
       [--prompt-tokens 32 128 512] [--decode-tokens 32]

"exact" is the engine as it is: a prompt's last token left alone after a prefix-cache hit
is prefilled as a one-row chunk, prompt rows take the integer GEMM at any row count, each
prompt chunk's last row attends by exo's row kernel. "before" puts back, in the same
process, what ran before: that token as a decode step (exo's decode layer), the decode
kernels for prompt chunks of up to 7 rows, flash attention for every prompt row. Per run
and mode: the cold TTFT of a fresh random prompt (prefix cache cleared), the TTFT of the
same prompt sent again (a hit of all but its last token), and the decode tok/s of the cold
request after its first token. Modes alternate run by run so background load hits both
alike; each figure is the median (min-max) over `--runs`.
"""

from __future__ import annotations

import argparse
import contextvars
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from exo.benchmark.prompts import ModelText
from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.worker.engines.torch.batching import step_layout
from exo.worker.engines.torch.batching.batch_attention import lean_step_of
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.model import direct_forward

DEFAULT_MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")


@contextmanager
def before(engine: TorchEngine) -> Iterator[None]:
    """The engine's paths as they were before the exact prefix-hit path, for this block."""
    lean = lean_step_of(engine.model)
    assert isinstance(lean, direct_forward.LeanModel)
    running = step_layout.RunningRequest
    exact_prefilling = running.prefilling
    exact_product = direct_forward.PROMPT_PRODUCT
    running.prefilling = property(lambda self: len(self.tokens) - self.computed > 1)  # type: ignore[method-assign,assignment]
    direct_forward.PROMPT_PRODUCT = contextvars.ContextVar("unread", default=False)
    lean._row_kernel = False
    try:
        yield
    finally:
        running.prefilling = exact_prefilling  # type: ignore[method-assign]
        direct_forward.PROMPT_PRODUCT = exact_product
        lean._row_kernel = True


def timed(
    engine: TorchEngine, text: ModelText, prompt: str, decode_tokens: int
) -> tuple[float, float]:
    """(TTFT in seconds, decode tok/s after the first token) of one greedy request."""
    params = TextGenerationTaskParams(
        model=ModelId("bench"), prompt=prompt, max_tokens=decode_tokens, temperature=0.0,
        logit_bias={token: -100.0 for token in text.eos_token_ids},
    )  # fmt: skip
    start = time.perf_counter()
    first = last = 0.0
    count = 0
    for piece in engine.generate(params):
        now = time.perf_counter()
        if count == 0:
            first = now
        count += len(piece.token_ids)
        last = now
    return first - start, (count - 1) / (last - first) if last > first else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--decode-tokens", type=int, default=32)
    arguments = parser.parse_args()
    card = load_builtin_cards()[DEFAULT_MODEL]
    model_dir = prepare_model(card, models_dir(), offline=False)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(model_dir, shard)
    engine.warmup()
    text = ModelText.load(model_dir)
    seeds = iter(range(1_000_000))
    for length in arguments.prompt_tokens:
        figures: dict[str, dict[str, list[float]]] = {
            mode: {"cold TTFT ms": [], "hit TTFT ms": [], "decode tok/s": []}
            for mode in ("before", "exact")
        }
        for run in range(arguments.runs + 1):  # the first run warms up
            for mode in ("before", "exact") if run % 2 else ("exact", "before"):
                prompt, _ = text.random_prompt(length, next(seeds))
                engine.clear_prefix_cache()
                with before(engine) if mode == "before" else nullcontext():
                    cold, decode = timed(engine, text, prompt, arguments.decode_tokens)
                    hit, _ = timed(engine, text, prompt, 1)
                if run:
                    figures[mode]["cold TTFT ms"].append(cold * 1e3)
                    figures[mode]["hit TTFT ms"].append(hit * 1e3)
                    figures[mode]["decode tok/s"].append(decode)
        for name in ("cold TTFT ms", "hit TTFT ms", "decode tok/s"):
            cells = [
                f"{mode} {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
                for mode, values in ((mode, figures[mode][name]) for mode in figures)
            ]
            print(f"{length:>5} tokens  {name:<13} " + "  ".join(cells))


if __name__ == "__main__":
    main()
