"""What sliding-window layers keeping only their window saves: KV bytes per token of a model
computed from its config (untrimmed: every layer holds every position; trimmed: the budget's
count, `batching/kv_footprint.py`), and the resident KV memory of one long prompt measured
on the real model, trimmed and untrimmed (each in its own process).

Usage: PYTHONPATH=src python bench/bench_sliding_window_kv.py [--model DIR] [--items 700]

The model directory defaults to Gemma 3 270M as the engine tests fetch it
(~/.cache/exo-test-models/google--gemma-3-270m). The prompt is a raw text of `--items`
short sentences (700: ~6.4k tokens); 8 tokens are generated greedily. Resident bytes are
the pages of the slot buffers present in memory (`mincore(2)`, Linux), the most over the
request's steps, then those of its prefix-cache entry; both runs print their text, which
must be the same. Figures: docs/benchmarks/2026-12-05-sliding-window-kv.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

MIB = 2**20
DEFAULT_MODEL = Path.home() / ".cache" / "exo-test-models" / "google--gemma-3-270m"


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s pages present in memory (`mincore`)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = -(-(end - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(value & 1 for value in vector) * page


def per_token_table(config: dict[str, Any]) -> None:
    from exo.worker.engines.torch.batching.kv_footprint import KVFootprint

    text = config.get("text_config", config)
    window = text["sliding_window"]
    windows = tuple(window if kind == "sliding_attention" else None for kind in text["layer_types"])
    head_bytes = text["num_key_value_heads"] * text["head_dim"] * 2 * 2  # K and V, bfloat16
    footprint = KVFootprint(windows)
    print(f"{len(windows)} layers, {sum(w is not None for w in windows)} windowed ({window})")
    print("length   untrimmed B/token   trimmed B/token (budget count)   exactly min(L, w)")
    for length in (2_048, 8_192, 32_768):
        trimmed = footprint.tokens(length) * len(windows) * head_bytes / length
        exact = sum(min(length, w or length) for w in windows) * head_bytes / length
        print(
            f"{length:>6}   {len(windows) * head_bytes:>17,}   {trimmed:>30,.0f}   {exact:>17,.0f}"
        )
    print(f"an 8,192-token budget fits one request of {footprint.longest(8_192):,} tokens")


def measure(model: Path, items: int, trimmed: bool) -> dict[str, Any]:
    """One request's resident KV, in this process."""
    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.common import ModelId
    from exo.shared.types.shards import ShardMetadata
    from exo.shared.types.text_generation import TextGenerationTaskParams
    from exo.worker.engines.torch import engine_scheduler
    from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
    from exo.worker.engines.torch.engine import TorchEngine

    if not trimmed:

        class Untrimmed(SlotKVCache):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.pop("windows", None)
                super().__init__(*args[:7], **kwargs)

        engine_scheduler.SlotKVCache = Untrimmed  # type: ignore[misc]
    card = card_from_local_directory(model)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(model, shard)
    text = " ".join(f"item {index} is {index * 7 % 13}." for index in range(items))
    params = TextGenerationTaskParams(
        model=ModelId("m"), prompt=text, temperature=0.0, max_tokens=8
    )
    prompt = len(engine.render_prompt(params).token_ids)
    engine.scheduler.add(engine.build_request(params, request_id="r"))
    cache = engine.scheduler._cache
    most, pieces, started = 0, [], time.perf_counter()
    while engine.has_work:
        pieces += [piece.text for _, piece in engine.step()]
        if cache.occupied:
            most = max(most, sum(resident_bytes(t) for t in (*cache.keys, *cache.values)))
    seconds = time.perf_counter() - started
    engine.store_finished()
    prefix = engine.scheduler.prefix_cache
    assert prefix is not None
    entry = sum(resident_bytes(entry.kv) for entry in prefix._entries.values())
    return {
        "trimmed": trimmed, "prompt_tokens": prompt, "slot_mib": most / MIB,
        "entry_mib": entry / MIB, "seconds": seconds, "text": "".join(map(str, pieces)),
        "kv_dtype": str(cache.keys[0].dtype),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--items", type=int, default=700)
    parser.add_argument("--one", choices=("trimmed", "untrimmed"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.one:
        result = measure(arguments.model, arguments.items, arguments.one == "trimmed")
        print(json.dumps(result))
        return
    per_token_table(json.loads((arguments.model / "config.json").read_text()))
    for kind in ("trimmed", "untrimmed"):
        output = subprocess.run(
            [sys.executable, __file__, "--model", str(arguments.model), "--items",
             str(arguments.items), "--one", kind],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        result = json.loads(output.strip().splitlines()[-1])
        print(
            f"{kind}: {result['prompt_tokens']} prompt tokens ({result['kv_dtype']} KV): slot "
            f"{result['slot_mib']:.1f} MiB resident at most, prefix entry "
            f"{result['entry_mib']:.1f} MiB; {result['seconds']:.0f} s; text {result['text']!r}"
        )


if __name__ == "__main__":
    main()
