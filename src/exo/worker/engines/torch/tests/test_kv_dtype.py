"""The KV cache's dtype (`--kv-cache-dtype`): bfloat16 keys and values (the CPU default)
against float32 ones on tiny random models of every family, teacher-forced (`lean_steps`:
the same tokens whatever the logits), through exo's decode layer (native/decode_layer.cpp,
AVX512 and AVX2 vectors) and the lean forward's torch operators; how the dtype is chosen.
The cost on the real models is measured by bench/bench_kv_quality.py
(docs/benchmarks/2026-12-05-kv-bf16.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from exo.shared.models.kv_cache_memory import (
    KV_CACHE_DTYPE_BYTES,
    KV_CACHE_VALUE_BYTES,
    kv_cache_tokens_for_dtype,
    kv_geometry_of_config,
)
from exo.testing.tiny_models import ARCHITECTURES, save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import lean_step_of
from exo.worker.engines.torch.batching.kv_memory import KV_CACHE_DTYPE_ENV, kv_cache_torch_dtype
from exo.worker.engines.torch.model.direct_forward import LeanModel
from exo.worker.engines.torch.model.families import family_by_name
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.quant.native_kernels import NATIVE_INT4_ENV, built_int4_kernel
from exo.worker.engines.torch.tests import lean_steps
from exo.worker.engines.torch.tests.test_distributed import make_shard

CPU = torch.device("cpu")
VOCAB_PROBE = 1000  # forced token ids are drawn below this
# Largest teacher-forced KL(float32 KV || bfloat16 KV) per next-token distribution, in nats,
# on these tiny models (their logits are ~0.1 wide, so this checks the path more than the
# cost; the real models' cost: docs/benchmarks/2026-12-05-kv-bf16.md). Measured up to
# ~1e-7 here; the bound leaves room for other CPUs' sums.
TINY_KV_KL_BOUND = 1e-5
# |exo's decode layer - torch operators| over the same bfloat16 cache: both widen the same
# stored values and sum in float32 (a key rounded to the other side of a bfloat16 step
# after a last-bit difference upstream moves a logit by ~1e-5 at most here).
PATHS_TOLERANCE = 1e-4


# Plain attention, sliding windows and MLA's latent cache by default; the other families
# (attention sinks: gpt_oss) under `-m slow`.
DEFAULT_FAMILIES = ("llama", "gemma3", "deepseek_v3")
FAMILY_PARAMS = [
    pytest.param(name, marks=() if name in DEFAULT_FAMILIES else pytest.mark.slow, id=name)
    for name in ARCHITECTURES
]


class TinyDirs:
    """Tiny models of 2 layers, each saved on first use (dense families with heads of 32:
    exo's decode layer takes their linears)."""

    def __init__(self, factory: pytest.TempPathFactory, tokenizer_source: Path) -> None:
        self._factory = factory
        self._tokenizer_source = tokenizer_source
        self._saved: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self._saved:
            dense = family_by_name(name).moe is None
            shape: dict[str, Any] = {"hidden_size": 128, "head_dim": 32} if dense else {}
            self._saved[name] = save_tiny_model(
                self._factory.mktemp(f"kv-{name}"), name, self._tokenizer_source, n_layers=2,
                **shape,
            )  # fmt: skip
        return self._saved[name]


@pytest.fixture(scope="module")
def kv_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> TinyDirs:
    return TinyDirs(tmp_path_factory, real_model_dir)


@pytest.fixture()
def native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    assert built_int4_kernel() is not None, "exo's native kernels did not build"
    yield


def _load(model_dir: Path) -> Any:
    return load_model(model_dir, make_shard(model_dir, "pipeline", 0, 1), CPU, "float32")


def teacher_forced_kl(exact: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """KL(softmax(exact) || softmax(rounded)) per row of `[rows, vocab]` logits, in nats."""
    log_p = F.log_softmax(exact.double(), dim=-1)
    log_q = F.log_softmax(rounded.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_bf16_kv_within_bound_of_float32_kv(kv_dirs: TinyDirs, name: str, native: None) -> None:
    model = _load(kv_dirs[name])
    lean = lean_step_of(model)
    assert isinstance(lean, LeanModel)
    tokens = lean_steps.forced_tokens(VOCAB_PROBE)
    exact = lean_steps.run_single(model, tokens, lean=True, kv_dtype=torch.float32)
    rounded = lean_steps.run_single(model, tokens, lean=True, kv_dtype=torch.bfloat16)
    kl = teacher_forced_kl(exact, rounded)
    print(f"{name}: teacher-forced KL(float32 KV || bf16 KV) max {kl.max().item():.3g} nats")
    assert 0 < kl.max().item() < TINY_KV_KL_BOUND  # 0 would mean nothing was rounded
    assert torch.equal(exact.argmax(-1), rounded.argmax(-1))
    decode_layer = lean._decode_layer
    if decode_layer is None:  # MoE / MLA families: the torch operators ran already
        return
    lean._decode_layer = None
    try:
        operators = lean_steps.run_single(model, tokens, lean=True, kv_dtype=torch.bfloat16)
    finally:
        lean._decode_layer = decode_layer
    assert (rounded - operators).abs().max().item() < PATHS_TOLERANCE


def test_transformers_forward_over_a_bf16_cache(kv_dirs: TinyDirs) -> None:
    """transformers' own forward with the batched attention (`batched_attention_forward`,
    no lean step) stores and reads a bfloat16 cache too."""
    model = _load(kv_dirs["llama"])
    tokens = lean_steps.forced_tokens(VOCAB_PROBE)
    exact = lean_steps.run_single(model, tokens, lean=False, kv_dtype=torch.float32)
    rounded = lean_steps.run_single(model, tokens, lean=False, kv_dtype=torch.bfloat16)
    assert 0 < teacher_forced_kl(exact, rounded).max().item() < TINY_KV_KL_BOUND


def test_avx2_and_avx512_attention_agree(kv_dirs: TinyDirs, native: None) -> None:
    """The decode rows' 256-bit (AVX2) and 512-bit (AVX512) loops over a bfloat16 cache and
    a float32 one: the same products, summed in another order."""
    vector_bits = torch.ops.exo_native.decode_attention_vector_bits
    if vector_bits(0) != 512:
        pytest.skip("the native kernels were built without AVX512F here")
    model = _load(kv_dirs["gemma3"])  # sliding-window layers too
    tokens = lean_steps.forced_tokens(VOCAB_PROBE)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            wide = lean_steps.run_single(model, tokens, lean=True, kv_dtype=dtype)
            assert vector_bits(256) == 256
            narrow = lean_steps.run_single(model, tokens, lean=True, kv_dtype=dtype)
            vector_bits(512)
            assert (wide - narrow).abs().max().item() < PATHS_TOLERANCE
    finally:
        vector_bits(512)


def test_kv_dtype_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KV_CACHE_DTYPE_ENV, raising=False)
    gpu = torch.device("cuda")
    assert kv_cache_torch_dtype(None, CPU, torch.float32) == torch.bfloat16
    assert kv_cache_torch_dtype(None, gpu, torch.float16) == torch.float16
    assert kv_cache_torch_dtype("float32", CPU, torch.float32) == torch.float32
    monkeypatch.setenv(KV_CACHE_DTYPE_ENV, "float32")
    assert kv_cache_torch_dtype(None, CPU, torch.float32) == torch.float32
    assert kv_cache_torch_dtype("bfloat16", CPU, torch.float32) == torch.bfloat16
    monkeypatch.setenv(KV_CACHE_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match=KV_CACHE_DTYPE_ENV):
        kv_cache_torch_dtype(None, CPU, torch.float32)


def test_budget_in_bytes_and_tokens() -> None:
    """Placement sizes KV in the default dtype's (bfloat16) bytes; a float32 node keeps to
    those bytes with half the tokens."""
    assert KV_CACHE_VALUE_BYTES == KV_CACHE_DTYPE_BYTES["bfloat16"] == 2
    assert kv_cache_tokens_for_dtype(8192, None) == 8192
    assert kv_cache_tokens_for_dtype(8192, "bfloat16") == 8192
    assert kv_cache_tokens_for_dtype(8192, "float32") == 4096
    config = type("Config", (), {"num_attention_heads": 9, "num_key_value_heads": 3,
                                 "hidden_size": 576})()  # fmt: skip
    geometry = kv_geometry_of_config(config, 30)  # SmolLM2-135M's shape
    assert geometry.bytes_per_token == 30 * 3 * 64 * 2 * 2
