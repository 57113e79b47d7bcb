"""Embedding throughput (inputs/s) of exo against llama.cpp's embedding mode on the same
random weights, batches of 1 / 8 / 64 short texts: nomic-embed-text-v1.5's shape on exo's
encoder (`--model nomic`, the default) or Qwen3-Embedding-0.6B's on exo's decoder engine
(`--model qwen3`).

Usage: PYTHONPATH=src python bench/bench_embeddings.py [--model nomic|qwen3]
       [--batches 1 8 64] [--rounds 5] [--threads 2] [--min-tokens 24] [--max-tokens 40]
       [--gguf-type f16] [--layers N] [--weight-dtype int4] [--qwen-gguf-type q4_1]
       [--cache-dir DIR] [--json OUT.json]

The model: NomicBERT at nomic-embed-text-v1.5's shape (its config.json: 12 layers, hidden
768, 12 heads, SwiGLU MLP of 3072, rotary positions with base 1000, no biases, vocabulary
30,528, mean pooling), Gaussian weights (std 0.02, LayerNorms near 1) from a fixed seed,
rounded to float16 once and written twice with the same values: as the safetensors folder
exo loads (`exo.worker.engines.torch.embedding.encoder_models.load_encoder_model`, NomicBERT's
own tensor names, float32) and as a GGUF of llama.cpp's `nomic-bert` architecture
(`write_nomic_gguf`: tensor names from gguf-py's tensor map, matrices in `--gguf-type`,
norms and the token-type rows in float32, a WordPiece vocabulary of placeholder words),
both cached in `--cache-dir` (`bench/embedding_weights.py` writes both models).

Inputs are token ids, the same for both engines: `[CLS]`, random word ids, `[SEP]`, each
input's length drawn uniformly from `--min-tokens`..`--max-tokens` (special tokens
included); tokenizing is outside the timing on both sides. exo: `EncoderEmbeddingModel.embed`
(length-sorted, right-padded groups of up to 64 rows, float32). llama.cpp: llama-cpp-python
0.3.x with `embedding=True`, mean pooling, every input one sequence of one `llama_decode`
while their tokens fit `n_batch` (as its `Llama.embed` batches them), `n_batch` =
`n_ubatch` = `--llama-batch` (512, llama.cpp's default micro-batch: its attention over one
decode is `[tokens, tokens]` across every sequence in it, masked, so a larger one costs more).
Before timing, the pooled vectors of the largest batch are compared (cosine printed, with
the cosine of neighbouring inputs for scale) and every batch size runs once untimed.
Each round runs every batch size on exo and on llama.cpp, alternating which goes first;
inputs/s is the batch size over the median time. `torch.set_num_threads(--threads)` and the
same thread count for llama.cpp.

`--model qwen3`: Qwen3 at Qwen3-Embedding-0.6B's shape (28 layers, hidden 1024, 16 heads
of 128, 8 KV heads, MLP 3072, vocabulary 151,669, rope theta 1e6, tied embeddings;
`--layers` cuts the depth), Gaussian weights (std 0.02, embeddings 0.5, norms near 1) from
a fixed seed rounded to float16, written as the safetensors folder exo's engine loads
(`TorchEngine.load` in `--weight-dtype`, int4 by default as on any CPU node; then
`embedding_backend()`, last-token pooling: exo's own forward where the model has a lean
step, `EXO_LEAN_FORWARD=0` for transformers' forward) and as a llama.cpp `qwen3` GGUF
(`write_qwen_gguf`, matrices in `--qwen-gguf-type`: q4_1 by default, the block format of
exo's int4 groups; block types quantized by gguf-py, each engine thus rounding the same
float16 values its own way). Inputs: random word ids ending with the end token, as
Qwen3-Embedding's tokenizer ends every text; llama.cpp pools the last token
(`LLAMA_POOLING_TYPE_LAST`), otherwise as for nomic. The agreement printed is then the
two 4-bit roundings' (neighbouring inputs' cosine for scale).

On a shared machine other work slows both sides: the load average is printed, and only
ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from embedding_weights import (
    CLS_ID,
    DEFAULT_CACHE,
    MASK_ID,
    QWEN_END_ID,
    QWEN_FIRST_WORD,
    QWEN_GGUF_TYPES,
    SEP_ID,
    NomicShape,
    QwenShape,
    prepare_nomic,
    prepare_qwen,
)

# llama.cpp's pooling enum (`LLAMA_POOLING_TYPE_MEAN`).
LLAMA_POOLING_MEAN, LLAMA_POOLING_LAST = 1, 3


def random_qwen_inputs(
    count: int, min_tokens: int, max_tokens: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """`count` inputs of random word ids ending with `QWEN_END_ID` (Qwen3-Embedding's
    `<|endoftext|>` end), lengths uniform in `min_tokens..max_tokens` (the end included)."""
    rng = np.random.default_rng(seed)
    inputs = []
    for _ in range(count):
        length = int(rng.integers(min_tokens, max_tokens + 1))
        words = rng.integers(QWEN_FIRST_WORD, vocab_size, size=length - 1).tolist()
        inputs.append([*words, QWEN_END_ID])
    return inputs


def load_exo_qwen(folder: Path, weight_dtype: str) -> Any:
    """exo's decoder embedding backend over `folder` (`TorchEngine.load`, then
    `embedding_backend()`, last-token pooling as Qwen3-Embedding's card says)."""
    from typing import cast

    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.engine import TorchEngine
    from exo.worker.engines.torch.quant.quantize import WeightDtype

    card = card_from_local_directory(folder).model_copy(
        update={"capabilities": ("embedding",), "embedding_pooling": "last"}
    )
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(folder, shard, weight_dtype=cast(WeightDtype, weight_dtype))
    return engine.embedding_backend()


def random_inputs(
    count: int, min_tokens: int, max_tokens: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """`count` inputs of `[CLS] words.. [SEP]`, lengths uniform in `min_tokens..max_tokens`
    (special tokens included), word ids above the specials."""
    rng = np.random.default_rng(seed)
    inputs = []
    for _ in range(count):
        length = int(rng.integers(min_tokens, max_tokens + 1))
        words = rng.integers(MASK_ID + 1, vocab_size, size=length - 2).tolist()
        inputs.append([CLS_ID, *words, SEP_ID])
    return inputs


class LlamaCppEmbedder:
    """llama.cpp's embedding mode on a GGUF: each input one sequence, one `llama_decode` per
    call, pooled vectors read with `llama_get_embeddings_seq` (llama-cpp-python's
    `Llama.embed` loop, from token ids instead of text)."""

    def __init__(
        self, gguf_path: Path, threads: int, batch_tokens: int, pooling: int = LLAMA_POOLING_MEAN
    ) -> None:
        """Load the GGUF; `batch_tokens`: context, `n_batch` and `n_ubatch` (a non-causal
        model's batch must fit one micro-batch). llama-cpp-python sets the sequence count itself
        (`min(n_batch, llama_max_parallel_sequences())`, 256 in 0.3.x) in embedding mode.
        `pooling`: llama.cpp's pooling type (mean; last for Qwen3-Embedding)."""
        import llama_cpp

        self._binding = llama_cpp
        self.model = llama_cpp.Llama(
            model_path=str(gguf_path), embedding=True, pooling_type=pooling,
            n_ctx=batch_tokens, n_batch=batch_tokens, n_ubatch=batch_tokens,
            n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
            verbose=False,
        )  # fmt: skip
        self.width = int(self.model.n_embd())
        self.batch_tokens = batch_tokens

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """`[B, hidden]` float32 mean-pooled vectors, not normalized; consecutive inputs
        share one `llama_decode` while their tokens fit `n_batch` (as `Llama.embed`)."""
        rows: list[np.ndarray] = []
        pending: list[list[int]] = []
        for ids in inputs:
            if len(ids) > self.batch_tokens:
                raise ValueError(f"an input of {len(ids)} tokens is over n_batch")
            if sum(map(len, pending)) + len(ids) > self.batch_tokens:
                rows += self._decode(pending)
                pending = []
            pending.append(ids)
        rows += self._decode(pending)
        return np.stack(rows)

    def _decode(self, inputs: list[list[int]]) -> list[np.ndarray]:
        model = self.model
        model._batch.reset()
        for sequence, ids in enumerate(inputs):
            model._batch.add_sequence(ids, sequence, True)
        model._ctx.kv_cache_clear()
        model._ctx.decode(model._batch)
        model._batch.reset()
        rows = []
        for sequence in range(len(inputs)):
            pointer = self._binding.llama_get_embeddings_seq(model._ctx.ctx, sequence)
            rows.append(np.ctypeslib.as_array(pointer, shape=(self.width,)).copy())
        return rows

    def close(self) -> None:
        self.model.close()


def cosines(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two `[B, D]` arrays."""
    first = first / np.linalg.norm(first, axis=1, keepdims=True)
    second = second / np.linalg.norm(second, axis=1, keepdims=True)
    return np.sum(first * second, axis=1)


def _timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1, 8, 64], help="inputs per call, each timed"
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per batch size")
    parser.add_argument(
        "--threads", type=int, default=2, help="CPU threads for each engine (torch and llama.cpp)"
    )
    parser.add_argument(
        "--min-tokens", type=int, default=24, help="shortest input, special tokens included"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=40, help="longest input, special tokens included"
    )
    parser.add_argument(
        "--gguf-type", choices=("f16", "f32"), default="f16", help="GGUF matrix type for llama.cpp"
    )
    parser.add_argument(
        "--llama-batch",
        type=int,
        default=512,
        help="llama.cpp n_batch = n_ubatch = context in tokens (512: its defaults' n_ubatch)",
    )
    parser.add_argument(
        "--model",
        choices=("nomic", "qwen3"),
        default="nomic",
        help="nomic: nomic-embed-text-v1.5's shape on exo's encoder; qwen3: "
        "Qwen3-Embedding-0.6B's shape on exo's decoder engine (last-token pooling)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers (default: the model's, 12 for nomic-embed-text-v1.5, 28 for "
        "Qwen3-Embedding-0.6B)",
    )
    parser.add_argument(
        "--weight-dtype",
        choices=("int4", "int8", "float32"),
        default="int4",
        help="qwen3: how exo holds the linear weights (int4: its CPU default, groups of 32 "
        "with a scale and zero, as GGUF's Q4_1)",
    )
    parser.add_argument(
        "--qwen-gguf-type",
        choices=QWEN_GGUF_TYPES,
        default="q4_1",
        help="qwen3: the GGUF's matrix type for llama.cpp",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the random models are kept"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    arguments = parser.parse_args(argv)
    if arguments.min_tokens < 3 or arguments.max_tokens < arguments.min_tokens:
        parser.error("--min-tokens must be >= 3 and <= --max-tokens")

    import torch

    torch.set_num_threads(arguments.threads)
    largest = max(arguments.batches)
    batch_tokens = arguments.llama_batch
    exo_model: Any
    shape: NomicShape | QwenShape
    if arguments.model == "nomic":
        from exo.worker.engines.torch.embedding.encoder_models import load_encoder_model

        shape = NomicShape() if arguments.layers is None else NomicShape(layers=arguments.layers)
        folder, gguf_path = prepare_nomic(arguments.cache_dir, shape, arguments.gguf_type)
        exo_model = load_encoder_model(folder)
        llama = LlamaCppEmbedder(gguf_path, arguments.threads, batch_tokens)
        formats = f"{arguments.gguf_type} GGUF for llama.cpp, float32 in exo"
        make_inputs = random_inputs
    else:
        shape = QwenShape() if arguments.layers is None else QwenShape(layers=arguments.layers)
        folder, gguf_path = prepare_qwen(arguments.cache_dir, shape, arguments.qwen_gguf_type)
        exo_model = load_exo_qwen(folder, arguments.weight_dtype)
        llama = LlamaCppEmbedder(gguf_path, arguments.threads, batch_tokens, LLAMA_POOLING_LAST)
        formats = (
            f"{arguments.qwen_gguf_type} GGUF for llama.cpp, {arguments.weight_dtype} in exo "
            f"({'its own forward' if exo_model.runs_exo_forward else 'transformers forward'})"
        )
        make_inputs = random_qwen_inputs
    print(f"load average before: {os.getloadavg()}", flush=True)
    print(
        f"model {shape.key()} ({formats}), "
        f"inputs {arguments.min_tokens}..{arguments.max_tokens} tokens, "
        f"{arguments.threads} threads, llama.cpp n_batch = n_ubatch = {batch_tokens}"
    )
    inputs = {
        size: make_inputs(
            size, arguments.min_tokens, arguments.max_tokens, shape.vocab_size, seed=size
        )
        for size in arguments.batches
    }
    check = inputs[largest]
    exo_vectors = exo_model.embed(check).numpy()
    agreement = cosines(exo_vectors, llama.embed(check))
    # Different inputs' vectors, for scale: agreement near 1 means little unless these are not.
    apart = cosines(exo_vectors[:-1], exo_vectors[1:])
    print(
        f"cosine exo vs llama.cpp over {len(check)} inputs: min {agreement.min():.8f}, "
        f"largest 1 - cosine {float(1 - agreement.min()):.1e} "
        f"(neighbouring inputs in exo: mean {apart.mean():.3f})",
        flush=True,
    )
    for size in arguments.batches:  # warm-up: first-call allocations stay out of the timing
        exo_model.embed(inputs[size])
        llama.embed(inputs[size])
    times: dict[int, dict[str, list[float]]] = {
        size: {"exo": [], "llama.cpp": []} for size in arguments.batches
    }
    for round_index in range(arguments.rounds):
        for size in arguments.batches:
            batch = inputs[size]
            calls = [
                ("exo", lambda batch=batch: exo_model.embed(batch)),
                ("llama.cpp", lambda batch=batch: llama.embed(batch)),
            ]
            if round_index % 2:
                calls.reverse()
            for engine, call in calls:
                times[size][engine].append(_timed(call))
    llama.close()
    print(f"load average after: {os.getloadavg()}")
    print(f"{'batch':>5} {'tokens':>7} {'exo in/s':>10} {'llama.cpp in/s':>15} {'exo/llama':>10}")
    results = []
    for size in arguments.batches:
        exo_rate = size / statistics.median(times[size]["exo"])
        llama_rate = size / statistics.median(times[size]["llama.cpp"])
        tokens = sum(len(ids) for ids in inputs[size])
        print(f"{size:>5} {tokens:>7} {exo_rate:>10.1f} {llama_rate:>15.1f} "
              f"{exo_rate / llama_rate:>9.2f}x")  # fmt: skip
        results.append({"batch": size, "tokens": tokens, "exo_inputs_per_s": exo_rate,
                        "llama_cpp_inputs_per_s": llama_rate, "times_s": times[size]})  # fmt: skip
    if arguments.json is not None:
        arguments.json.write_text(
            json.dumps(
                {
                    "model": shape.key(),
                    "formats": formats,
                    "cosine_min": float(agreement.min()),
                    "threads": arguments.threads,
                    "results": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
