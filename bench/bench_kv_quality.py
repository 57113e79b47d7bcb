"""What storing the KV cache in bfloat16 (the CPU default, `--kv-cache-dtype`) costs a model's
next-token distributions: a long text teacher-forced through the engine's batched step,
all but its last `--decode-tokens` in one prefill (every position's logits), then one decode
step per token (exo's decode layer reading the cache where it runs), once with float32 keys
and values and once with bfloat16 ones, on the same weights.

Usage: PYTHONPATH=src python bench/bench_kv_quality.py [--models M1 M2] [--tokens 2048]
       [--decode-tokens 256] [--text FILE] [--models-dir DIR]

Prints, per model, the teacher-forced KL(float32 KV || bfloat16 KV) over the prefill's
last `--decode-tokens` positions (only those rows' logits are kept: a 262k vocabulary times
2k positions would be gigabytes) and over the decode positions (mean, 99th percentile,
largest, in nats), the
share of positions whose most likely token changed, and the KV bytes per token of each
dtype. The models must be prepared already (`exo` serves them, or the engine tests
fetched them into ~/.cache/exo-test-models); the text defaults to this repository's docs,
concatenated. Figures: docs/benchmarks/2026-12-05-kv-bf16.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.kv_cache_memory import KV_CACHE_DTYPE_BYTES, kv_geometry_of_config
from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    attention_layers,
    forward_batch,
    use_batched_attention,
)
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.model.families import family_for_architecture

REPOSITORY = Path(__file__).parents[1]
TEST_MODELS_DIR = Path.home() / ".cache" / "exo-test-models"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def forced_logits(
    model: Any, ids: list[int], prefill: int, dtype: torch.dtype, prefill_rows: int
) -> torch.Tensor:
    """`[prefill_rows + len(ids) - prefill, vocab]` float32 logits: the last `prefill_rows`
    positions of one prefill of `ids[:prefill]` into an empty cache of `dtype`, then each
    later position from one decode step fed the text's own token (teacher forcing)."""
    text_config: Any = model.config.get_text_config()
    windows = family_for_architecture(type(model).__name__).attention_windows(text_config)
    geometry = kv_geometry_of_config(text_config, len(windows))
    use_batched_attention(model)
    cache = SlotKVCache(
        geometry.layers, geometry.kv_heads, geometry.head_dim, dtype, torch.device("cpu"), 1,
        geometry.latent_values,
    )  # fmt: skip
    slot = cache.allocate()
    cache.reserve(len(ids))
    layer_of = attention_layers(model)
    rows: list[torch.Tensor] = []
    with torch.inference_mode():
        segment = PrefillSegment(slot, 0, 0, prefill)
        plan = BatchPlan(cache, windows, [], [], [segment], layer_of)
        positions = list(range(prefill))
        rows.append(
            forward_batch(
                model, plan, torch.tensor([ids[:prefill]]), torch.tensor([positions]),
                torch.tensor(positions[-prefill_rows:]),
            )
        )  # fmt: skip
        for position in range(prefill, len(ids)):
            plan = BatchPlan(cache, windows, [slot], [position], [], layer_of)
            rows.append(
                forward_batch(
                    model, plan, torch.tensor([[ids[position]]]), torch.tensor([[position]]),
                    torch.tensor([0]),
                )
            )  # fmt: skip
    return torch.cat(rows)


def summary(name: str, reference: torch.Tensor, rounded: torch.Tensor) -> str:
    """KL(softmax(reference) || softmax(rounded)) of `[rows, vocab]` logits, row by row in
    float64, and how often the most likely token differs."""
    kl = torch.cat([
        (log_p.exp() * (log_p - log_q)).sum(dim=-1)
        for log_p, log_q in (
            (torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1))
            for p, q in zip(reference.split(64), rounded.split(64), strict=True)
        )
    ])  # fmt: skip
    changed = (reference.argmax(-1) != rounded.argmax(-1)).double().mean()
    return (
        f"  {name:7s} ({kl.numel():5d} positions): KL mean {float(kl.mean()):.2e}, "
        f"p99 {float(kl.quantile(0.99)):.2e}, max {float(kl.max()):.2e} nats; "
        f"most likely token changed at {100 * float(changed):.2f}% of positions"
    )


def prepared_whole_model(
    cards: Mapping[ModelId, ModelCard], model_id: str, directory: Path | None
) -> tuple[Path, ShardMetadata] | None:
    """The prepared directory of catalog model `model_id` (in `directory`, else the engine
    tests' cache when it holds it, else exo's models directory; no download) and a shard of
    the whole model; None when the catalog has no such model."""
    card = cards.get(ModelId(model_id))
    if card is None:
        return None
    directory = directory or (
        TEST_MODELS_DIR if (TEST_MODELS_DIR / model_id.replace("/", "--")).is_dir()
        else models_dir()
    )  # fmt: skip
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    return prepare_model(card, directory, offline=True), shard


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--models",
        nargs="+",
        default=["HuggingFaceTB/SmolLM2-135M-Instruct", "google/gemma-3-270m"],
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--text", type=Path, default=None)
    parser.add_argument("--models-dir", type=Path, default=None)
    arguments = parser.parse_args()
    if arguments.text is not None:
        text = arguments.text.read_text()
    else:
        pages = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
        text = "\n\n".join(page.read_text() for page in pages)
    cards = load_builtin_cards()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"teacher-forced KL(float32 KV || bfloat16 KV), same weights (the engine's default)"
    )
    for model_id in arguments.models:
        prepared = prepared_whole_model(cards, model_id, arguments.models_dir)
        if prepared is None:
            print(f"{model_id} is not in the catalog", file=sys.stderr)
            return 2
        model_dir, shard = prepared
        engine = TorchEngine.load(model_dir, shard)
        ids = engine.tokenizer(text)["input_ids"][: arguments.tokens]
        prefill = max(1, len(ids) - arguments.decode_tokens)
        rows = min(prefill, arguments.decode_tokens)  # the prefill's last positions compared
        logits = {}
        for name, dtype in DTYPES.items():
            started = time.perf_counter()
            logits[name] = forced_logits(engine.model, ids, prefill, dtype, rows)
            print(f"  {name} KV: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        text_config: Any = engine.model.config.get_text_config()
        windows = family_for_architecture(type(engine.model).__name__).attention_windows(
            text_config
        )
        geometry = kv_geometry_of_config(text_config, len(windows))
        sizes = ", ".join(
            f"{name} {replace(geometry, value_bytes=size).bytes_per_token:,}"
            for name, size in KV_CACHE_DTYPE_BYTES.items()
        )
        print(
            f"{model_id} ({engine.weight_dtype} weights): {len(ids)} tokens, the first "
            f"{prefill} in one prefill (its last {rows} compared), then one decode step each; "
            f"KV bytes per token: {sizes}"
        )
        reference, rounded = logits["float32"], logits["bfloat16"]
        print(summary("prefill", reference[:rows], rounded[:rows]))
        print(summary("decode", reference[rows:], rounded[rows:]))
        print(summary("all", reference, rounded))
        del engine
    return 0


if __name__ == "__main__":
    sys.exit(main())
