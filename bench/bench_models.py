"""Load time and peak memory while loading, per model family, against the card's estimate.

Usage: PYTHONPATH=src python bench/bench_models.py [--weight-dtype int4] [--layers 8]
       [--hidden 512] [--models-dir DIR]

One row per model family (a random-weight model built with the family file's transformers
class: `--hidden` wide, 4x that MLP, `--layers` layers, 8192-token vocabulary) and one for
the real default model (SmolLM2-135M, converted from its PyPI package on first use). Each
load runs in a fresh process whose imports were warmed up by loading a 1-layer model first;
peak RSS growth is Linux's high-water mark (`VmHWM`, reset just before the load through
`/proc/self/clear_refs`) minus the resident size before it. Columns: load seconds, peak RSS
growth while loading, RSS growth after, and the card-based estimates placement uses
(`exo.shared.models.memory`): resident bytes and loading peak in the chosen format, and the
float32 size. Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as multiprocessing

from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir as default_models_dir
from exo.shared.models.cards import card_from_local_directory, load_builtin_cards
from exo.shared.models.memory import loading_peak_bytes, resident_weight_bytes
from exo.shared.types.common import ModelId
from exo.testing.tiny_models import ARCHITECTURES, save_tiny_model

DEFAULT_MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
MB = 1e6
CHILD_DEADLINE_S = 600.0


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB$", Path("/proc/self/status").read_text(), re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def _load_in_child(warmup_dir: str, model_dir: str, weight_dtype: str, results: Any) -> None:
    import torch

    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.model.loading import load_model

    def whole(directory: str) -> ShardMetadata:
        card = card_from_local_directory(Path(directory))
        return ShardMetadata(
            sharding="pipeline",
            model_card=card,
            device_rank=0,
            world_size=1,
            start_layer=0,
            end_layer=card.n_layers,
        )

    try:
        warm = load_model(Path(warmup_dir), whole(warmup_dir), torch.device("cpu"), "int4")
        del warm
        gc.collect()
        shard = whole(model_dir)
        baseline = _status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        started = time.perf_counter()
        model = load_model(Path(model_dir), shard, torch.device("cpu"), weight_dtype)  # type: ignore[arg-type]
        seconds = time.perf_counter() - started
        peak = _status_bytes("VmHWM") - baseline
        after = _status_bytes("VmRSS") - baseline
        del model
        results.put((seconds, peak, after, None))
    except BaseException as error:
        results.put((0.0, 0, 0, repr(error)))


def measure(warmup_dir: Path, model_dir: Path, weight_dtype: str) -> tuple[float, int, int]:
    """(load seconds, peak RSS growth, RSS growth after) of one load in a fresh process."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(
        target=_load_in_child, args=(str(warmup_dir), str(model_dir), weight_dtype, results)
    )
    child.start()
    try:
        seconds, peak, after, error = results.get(timeout=CHILD_DEADLINE_S)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if error is not None:
        raise RuntimeError(f"loading {model_dir} failed: {error}")
    return seconds, peak, after


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--weight-dtype", default="int4", choices=("float32", "int8", "int4"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--models-dir", type=Path, default=None)
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("reads /proc/self: Linux only")
    card = load_builtin_cards()[DEFAULT_MODEL]
    real_dir = prepare_model(card, args.models_dir or default_models_dir(), offline=False)
    header = (
        f"{'model':<22}{'load s':>8}{'peak MB':>9}{'after MB':>10}"
        f"{'est. resident':>15}{'est. peak':>11}{'float32 MB':>12}"
    )
    print(f"weight dtype {args.weight_dtype}; tiny models: {args.layers} layers, hidden "
          f"{args.hidden}, MLP {4 * args.hidden}, vocabulary 8192")  # fmt: skip
    print(header)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        warmup = save_tiny_model(root / "warmup", "llama", real_dir, n_layers=1)
        rows: list[tuple[str, Path]] = []
        for name in ARCHITECTURES:
            directory = save_tiny_model(
                root / name, name, real_dir, n_layers=args.layers, vocab_size=8192,
                hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
            )  # fmt: skip
            rows.append((name, directory))
        rows.append(("SmolLM2-135M (real)", real_dir))
        for name, directory in rows:
            model_card = card_from_local_directory(directory)
            seconds, peak, after = measure(warmup, directory, args.weight_dtype)
            fmt: Any = args.weight_dtype
            print(
                f"{name:<22}{seconds:>8.2f}{peak / MB:>9.1f}{after / MB:>10.1f}"
                f"{resident_weight_bytes(model_card, fmt) / MB:>15.1f}"
                f"{loading_peak_bytes(model_card, fmt) / MB:>11.1f}"
                f"{resident_weight_bytes(model_card, 'float32') / MB:>12.1f}"
            )


if __name__ == "__main__":
    main()
