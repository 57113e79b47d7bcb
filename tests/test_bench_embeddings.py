"""bench/bench_embeddings.py's model writer: the NomicBERT GGUF it writes loads in llama.cpp
(llama-cpp-python, embedding mode) and pools the same vectors as exo's encoder over the
safetensors folder written from the same values. A small shape; slow (llama.cpp loads)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_embeddings.py"
# float16 weights on the llama.cpp side (f32 activations), float32 in exo: agreement measured
# at about 1e-7; a wrong tensor mapping (swapped gate and up, unrotated keys) is far outside.
COSINE_BOUND = 1e-4


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_embeddings", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tensor_type", ["f16", "f32"])
def test_gguf_writer_loads_in_llama_cpp_and_matches_exo(tmp_path: Path, tensor_type: str) -> None:
    pytest.importorskip("llama_cpp")
    bench = _bench()
    from exo.worker.engines.torch.embedding.encoder_models import load_encoder_model

    shape = bench.NomicShape(
        hidden_size=64, layers=2, heads=4, intermediate_size=128, vocab_size=200,
        max_positions=128,
    )  # fmt: skip
    folder, gguf_path = bench.prepare_nomic(tmp_path, shape, tensor_type)
    inputs = bench.random_inputs(6, 5, 30, shape.vocab_size, seed=1)
    exo_vectors = load_encoder_model(folder).embed(inputs).numpy()
    llama = bench.LlamaCppEmbedder(gguf_path, threads=1, batch_tokens=64)
    try:
        # 64-token decodes: the 6 inputs span several llama_decode calls.
        llama_vectors = llama.embed(inputs)
    finally:
        llama.close()
    assert llama_vectors.shape == exo_vectors.shape == (6, 64)
    agreement = bench.cosines(exo_vectors, llama_vectors)
    assert float(1 - agreement.min()) < COSINE_BOUND, agreement
    # The bound separates: different inputs' vectors are much further apart than it.
    apart = bench.cosines(exo_vectors[:-1], exo_vectors[1:])
    assert float(1 - apart.max()) > 100 * COSINE_BOUND, apart
    assert np.all(np.isfinite(llama_vectors))


@pytest.mark.parametrize("tensor_type", ["f16", "f32"])
def test_qwen3_gguf_writer_loads_in_llama_cpp_and_matches_exo(
    tmp_path: Path, tensor_type: str
) -> None:
    """The Qwen3 GGUF (llama.cpp's `qwen3`, last-token pooling) against exo's decoder
    embedding backend (its own forward, float32 weights) over the folder written from the
    same values; a head width that is not hidden / heads, as Qwen3-Embedding's."""
    pytest.importorskip("llama_cpp")
    bench = _bench()
    shape = bench.QwenShape(
        hidden_size=64, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate_size=128,
        vocab_size=400, max_positions=128,
    )  # fmt: skip
    folder, gguf_path = bench.prepare_qwen(tmp_path, shape, tensor_type)
    inputs = bench.random_qwen_inputs(6, 5, 30, shape.vocab_size, seed=1)
    backend = bench.load_exo_qwen(folder, "float32")
    assert backend.runs_exo_forward
    exo_vectors = backend.embed(inputs).numpy()
    llama = bench.LlamaCppEmbedder(
        gguf_path, threads=1, batch_tokens=64, pooling=bench.LLAMA_POOLING_LAST
    )
    try:
        llama_vectors = llama.embed(inputs)
    finally:
        llama.close()
    assert llama_vectors.shape == exo_vectors.shape == (6, 64)
    agreement = bench.cosines(exo_vectors, llama_vectors)
    assert float(1 - agreement.min()) < COSINE_BOUND, agreement
    # Every input ends with the same token, whose embedding dominates a 2-layer random
    # model's last state: different inputs are only ~1e-3 apart (measured), the engines
    # ~1e-7 (float32 rounding), so the agreement still separates inputs by 1000x.
    apart = bench.cosines(exo_vectors[:-1], exo_vectors[1:])
    disagreement = max(float(1 - agreement.min()), 1e-7)
    assert float(1 - apart.max()) > 1000 * disagreement, (apart, agreement)
