"""Loading quantizes layer by layer: a process's peak resident memory while loading an int4
model stays well below the float32 weights, and what stays resident is the int4 size.

Measured in a fresh spawned process (its imports warmed up by loading a 1-layer model
first) with Linux's peak-RSS counter, reset just before the load (`/proc/self/clear_refs`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as multiprocessing

from exo.shared.models.cards import card_from_local_directory
from exo.shared.models.memory import loading_peak_bytes, resident_weight_bytes
from exo.testing.tiny_models import save_tiny_model

CHILD_DEADLINE_S = 180.0


def _status_bytes(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB$", status, re.MULTILINE)
    assert match is not None, field
    return int(match.group(1)) * 1024


def _measure_load(warmup_dir: str, model_dir: str, weight_dtype: str, results: Any) -> None:
    """In a fresh process: warm up, then (peak RSS growth, RSS growth after) of one load."""
    import gc

    import torch

    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.model.loading import load_model

    torch.set_num_threads(1)

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
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
        model = load_model(Path(model_dir), shard, torch.device("cpu"), weight_dtype)  # type: ignore[arg-type]
        peak = _status_bytes("VmHWM") - baseline
        after = _status_bytes("VmRSS") - baseline
        results.put(("ok", peak, after, sum(1 for _ in model.parameters())))
    except BaseException as error:  # reported to the test, which fails with it
        results.put(("error", repr(error), 0, 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_int4_loading_peak_stays_well_below_float32(tmp_path: Path, real_model_dir: Path) -> None:
    # ~99 MB of float32 weights in 6 layers (~16 MB each); ~17 MB once in int4.
    model_dir = save_tiny_model(
        tmp_path / "model", "llama", real_model_dir, n_layers=6, vocab_size=1024,
        hidden_size=512, intermediate_size=2048, tie_word_embeddings=False,
    )  # fmt: skip
    warmup_dir = save_tiny_model(tmp_path / "warmup", "llama", real_model_dir, n_layers=1)
    card = card_from_local_directory(model_dir)
    float32_bytes = resident_weight_bytes(card, "float32")
    int4_bytes = resident_weight_bytes(card, "int4")
    assert int4_bytes < 0.2 * float32_bytes  # the model is big enough to tell them apart
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(
        target=_measure_load, args=(str(warmup_dir), str(model_dir), "int4", results)
    )
    child.start()
    try:
        kind, peak, after, _parameters = results.get(timeout=CHILD_DEADLINE_S)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
    assert kind == "ok", peak
    # One layer in float32 plus quantization scratch on top of the int4 weights, never the
    # whole float32 model (measured: peak ~58 MB, 18 MB resident after).
    assert peak < 0.7 * float32_bytes, (peak, float32_bytes, loading_peak_bytes(card, "int4"))
    assert after < 1.3 * int4_bytes, (after, int4_bytes)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_moe_loading_holds_one_expert_in_float32_at_a_time(
    tmp_path: Path, real_model_dir: Path
) -> None:
    """A MoE layer's experts are read and quantized one by one (each one's memory maps
    closed before the next): the peak stays below one sparse layer's experts in float32 on
    top of the int4 weights (reading the layer whole, then quantizing, measured 56 MiB)."""
    # 2 sparse layers of 32 experts of 3 x 512 x 256: ~50 MB of float32 experts per layer.
    model_dir = save_tiny_model(
        tmp_path / "model", "qwen3_moe", real_model_dir, n_layers=2, vocab_size=1024,
        hidden_size=512, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
        mlp_only_layers=[], tie_word_embeddings=False,
    )  # fmt: skip
    warmup_dir = save_tiny_model(tmp_path / "warmup", "llama", real_model_dir, n_layers=1)
    card = card_from_local_directory(model_dir)
    experts_float32 = 32 * 3 * 512 * 256 * 4
    int4_bytes = resident_weight_bytes(card, "int4")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(
        target=_measure_load, args=(str(warmup_dir), str(model_dir), "int4", results)
    )
    child.start()
    try:
        kind, peak, after, _parameters = results.get(timeout=CHILD_DEADLINE_S)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
    assert kind == "ok", peak
    print(f"MoE load: peak {peak / 2**20:.1f} MiB, after {after / 2**20:.1f} MiB, "
          f"int4 estimate {int4_bytes / 2**20:.1f} MiB, estimated peak "
          f"{loading_peak_bytes(card, 'int4') / 2**20:.1f} MiB")  # fmt: skip
    assert peak < int4_bytes + experts_float32 / 2, (peak, int4_bytes, experts_float32)
    assert after < 1.3 * int4_bytes, (after, int4_bytes)
