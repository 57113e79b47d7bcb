"""How much prefill's activation rounding moves a model's next-token distributions: a text is
teacher-forced through the engine's batched step in one prefill (every position's logits),
once per `--prefill-activations` value, each from its own engine load, against int16 (the
decode kernels' exact integer sums). "decode-int8" is a node with `--decode-activations
int8` (every int4 product's rows rounded to int8, other weights' prompt rows int16).

Usage: PYTHONPATH=src python bench/bench_prefill_rounding.py [--model MODEL_ID]
       [--tokens 400] [--roundings int8 bf16] [--text FILE]

Prints, per rounding, the mean and largest KL(int16 || rounding) over the positions and the
share of positions whose most likely token changed. The model must be prepared already
(`exo` serves it, or `bench/bench_engine.py` fetched it); the text defaults to this
repository's README. bf16 runs as int16 where the CPU has no AMX-BF16 (it says so).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.weight_formats import PREFILL_ACTIVATIONS
from exo.shared.types.common import ModelId
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
from exo.worker.engines.torch.quant.native_kernels import (
    bf16_prefill_available,
    set_decode_activations,
)

DECODE_INT8 = "decode-int8"


def all_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """`[len(ids), vocab]` float64 logits of one prefill of `ids` from an empty cache."""
    text_config: Any = model.config.get_text_config()
    windows = family_for_architecture(type(model).__name__).attention_windows(text_config)
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
    use_batched_attention(model)
    cache = SlotKVCache(len(windows), kv_heads, head_dim, torch.float32, torch.device("cpu"), 1)
    slot = cache.allocate()
    cache.reserve(len(ids))
    plan = BatchPlan(
        cache, windows, [], [], [PrefillSegment(slot, 0, 0, len(ids))], attention_layers(model)
    )
    positions = list(range(len(ids)))
    with torch.inference_mode():
        logits = forward_batch(
            model, plan, torch.tensor([ids]), torch.tensor([positions]), torch.tensor(positions)
        )
    return logits.double()


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="google/gemma-3-270m")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument(
        "--roundings",
        nargs="+",
        default=["int8", "bf16"],
        choices=[*PREFILL_ACTIVATIONS, DECODE_INT8],
    )
    parser.add_argument("--text", type=Path, default=Path(__file__).parents[1] / "README.md")
    arguments = parser.parse_args()
    card = load_builtin_cards().get(ModelId(arguments.model))
    if card is None:
        print(f"{arguments.model} is not in the catalog", file=sys.stderr)
        return 2
    model_dir = prepare_model(card, models_dir(), offline=True)
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )
    logits: dict[str, torch.Tensor] = {}
    ids: list[int] = []
    for rounding in ["int16", *arguments.roundings]:
        if rounding == DECODE_INT8:
            engine = TorchEngine.load(model_dir, shard, decode_activations="int8")
        else:
            engine = TorchEngine.load(model_dir, shard, prefill_activations=rounding)  # type: ignore[arg-type]
        if not ids:
            ids = engine.tokenizer(arguments.text.read_text())["input_ids"][: arguments.tokens]
        logits[rounding] = all_logits(engine.model, ids)
        set_decode_activations("int16")
        del engine
    reference = torch.log_softmax(logits["int16"], dim=-1)
    print(f"{arguments.model}: {len(ids)} teacher-forced positions, against int16")
    for rounding in arguments.roundings:
        rounded = torch.log_softmax(logits[rounding], dim=-1)
        kl = (reference.exp() * (reference - rounded)).sum(dim=-1)
        changed = (logits["int16"].argmax(-1) != logits[rounding].argmax(-1)).double().mean()
        note = (
            " (no AMX-BF16 here: int16)"
            if rounding == "bf16" and not bf16_prefill_available()
            else ""
        )
        print(
            f"{rounding:11s} KL mean {float(kl.mean()):.2e} max {float(kl.max()):.2e}, "
            f"most likely token changed at {100 * float(changed):.2f}% of positions{note}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
