"""The direct forward (model/direct_forward.py) against transformers' forward, on tiny random
models of every family: float32 logits within `FLOAT32_TOLERANCE` and the same greedy
tokens, single rank and sharded (pipeline x2, tensor x2, and expert x2 for MoE families:
llama by default, the other families under `-m slow`); int4 with bfloat16 activations
within `INT4_TOLERANCE` (teacher forcing: both paths are fed the same tokens,
`lean_steps`); the float32 fallback for CPUs without bfloat16, forced.
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from exo.testing.rank_processes import run_rank_processes
from exo.testing.tiny_models import ARCHITECTURES, save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    lean_step_of,
)
from exo.worker.engines.torch.model import direct_forward_parts
from exo.worker.engines.torch.model.direct_forward import LeanModel, enable_lean_forward
from exo.worker.engines.torch.model.families import family_by_name
from exo.worker.engines.torch.model.fusion import fuse_linears
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.quant.int4_groups import Int4Linear
from exo.worker.engines.torch.quant.int8_channels import Int8Linear
from exo.worker.engines.torch.quant.native_kernels import NATIVE_INT4_ENV
from exo.worker.engines.torch.quant.quantize import set_prefill_activations
from exo.worker.engines.torch.tests import lean_steps
from exo.worker.engines.torch.tests.test_distributed import GROUP_DEADLINE_S, make_shard

# Largest |lean - transformers| logit. float32: measured 0 (the same kernels in the same
# order) on every family; the bound leaves room for other CPUs' matmul blocking. int4 with
# bfloat16 activations against transformers' int4 path (float32 activations cast to
# bfloat16 at each kernel): measured up to 9e-3 on these models (the bfloat16 rounding of
# activations between kernels; logits here are ~0.1 wide).
FLOAT32_TOLERANCE = 1e-4
INT4_TOLERANCE = 5e-2
VOCAB_PROBE = 1000  # forced token ids are drawn below this
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    return {
        name: save_tiny_model(
            tmp_path_factory.mktemp(f"lean-{name}"), name, real_model_dir, n_layers=4
        )
        for name in ARCHITECTURES
    }


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    """Tiny models whose every decoder linear is int4 (outputs multiples of 64: heads of
    32), so exo's decode layer takes every layer."""
    return {
        name: save_tiny_model(
            tmp_path_factory.mktemp(f"lean-int4-{name}"),
            name,
            real_model_dir,
            n_layers=3,
            hidden_size=128,
            head_dim=32,
        )
        for name in ARCHITECTURES
    }


def _load(model_dir: Path, weight_dtype: str = "float32") -> Any:
    return load_model(model_dir, make_shard(model_dir, "pipeline", 0, 1), CPU, weight_dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_float32_lean_equals_transformers(tiny_dirs: dict[str, Path], name: str) -> None:
    model = _load(tiny_dirs[name])
    assert isinstance(lean_step_of(model), LeanModel)
    tokens = lean_steps.forced_tokens(VOCAB_PROBE)
    reference = lean_steps.run_single(model, tokens, lean=False)
    lean = lean_steps.run_single(model, tokens, lean=True)
    assert reference.shape == lean.shape == (15, model.config.vocab_size)
    assert (lean - reference).abs().max().item() < FLOAT32_TOLERANCE
    assert torch.equal(lean.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_int4_bf16_lean_within_tolerance(
    tiny_dirs: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NATIVE_INT4_ENV, "0")  # torch's kernels, which take bfloat16 rows
    model = _load(tiny_dirs[name], "int4")
    lean = lean_step_of(model)
    assert isinstance(lean, LeanModel)
    if not direct_forward_parts.cpu_has_native_bf16():
        lean = LeanModel(model, family_by_name(name), bf16=True)  # emulated, still correct
        model.__dict__["_exo_lean_step"] = lean
    assert lean.bf16
    tokens = lean_steps.forced_tokens(VOCAB_PROBE)
    reference = lean_steps.run_single(model, tokens, lean=False)
    lean_logits = lean_steps.run_single(model, tokens, lean=True)
    difference = (lean_logits - reference).abs().max().item()
    print(f"{name} int4: max |lean - transformers| = {difference:.3g}")
    assert 0 < difference < INT4_TOLERANCE  # 0 would mean the bfloat16 path did not run


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_int4_native_lean_equals_transformers(
    tiny_dirs: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """exo's int4 kernel takes float32 rows on both paths: only the order of the lean
    forward's float32 operations differs from transformers' (the kernel rounds activations
    to int16 blocks, so a last-bit difference can move a value by one step of 1/32767), and
    the int8 LM head still takes bfloat16 rows, where a last-bit difference before the cast
    can move a logit by one bfloat16 step (measured: 2^-8 on these models)."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    model = _load(tiny_dirs[name], "int4")
    lean = lean_step_of(model)
    assert isinstance(lean, LeanModel)
    projections = [
        projection
        for layer in lean.layers
        for projection in (layer.qkv, layer.output, layer.gate_up, layer.down, *_experts(layer))
        if projection is not None
    ]
    leaves = [part for projection in projections for part in projection.parts or [projection]]
    int4 = [leaf for leaf in leaves if isinstance(leaf.quantized, Int4Linear)]
    assert int4 and all(leaf.native and leaf.in_dtype == torch.float32 for leaf in int4)
    tokens = lean_steps.forced_tokens(VOCAB_PROBE)
    reference = lean_steps.run_single(model, tokens, lean=False)
    lean_logits = lean_steps.run_single(model, tokens, lean=True)
    assert (lean_logits - reference).abs().max().item() < 1e-2
    assert torch.equal(lean_logits.argmax(-1), reference.argmax(-1))


def _experts(layer: Any) -> list[Any]:
    """A MoE layer's experts' projections (gate/up fused, down), each expert's in turn."""
    if layer.moe is None:
        return []
    held = [expert for expert in layer.moe.experts if expert is not None]
    return [projection for expert in held for projection in (expert.gate_up, expert.down)]


# exo's decode layer (`native/decode_layer.cpp`) has no sparse MLP block: MoE models decode
# with the lean forward's operators (`test_moe.py` checks they do).
DENSE_ARCHITECTURES = tuple(name for name in ARCHITECTURES if family_by_name(name).moe is None)


def _output_and_down_in_bf16(model: Any, name: str) -> None:
    """Hold each layer's output and down projections as `Bf16Linear` (GGUF Q6_K's route)
    and rebuild the lean forward over them."""
    from exo.worker.engines.torch.quant.gguf_weights import Bf16Linear

    for layer in model.model.layers:
        for parent, attribute in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            linear = getattr(parent, attribute)
            setattr(parent, attribute, Bf16Linear(linear.weight.detach(), linear.bias))
    enable_lean_forward(model, family_by_name(name))


def _scaled_int8(linear: Any, block_size: int) -> Any:
    """`linear` as symmetric int8 blocks of `block_size` (GGUF Q8_0 / Q6_K's route)."""
    from exo.worker.engines.torch.quant.int8_blocks import ScaledInt8Linear

    weight = linear.weight.detach().float()
    blocks = weight.reshape(weight.shape[0], -1, block_size)
    scales = (blocks.abs().amax(dim=-1) / 127.0).clamp(min=1e-8).to(torch.bfloat16).float()
    values = torch.round(blocks / scales[..., None]).clamp(-127, 127).reshape(weight.shape)
    return ScaledInt8Linear(values, scales, linear.bias, block_size)


def _held_as_scaled_int8(model: Any, name: str) -> None:
    """Q/K/V and gate/up (or Phi-3's fused ones) as int8 blocks of 32 (fused by the lean
    forward), output and down as blocks of 16 (Q6_K's), then the lean forward rebuilt."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for attribute, linear in list(parent.named_children()):
                if isinstance(linear, torch.nn.Linear):
                    block_size = 16 if attribute in ("o_proj", "down_proj") else 32
                    setattr(parent, attribute, _scaled_int8(linear, block_size))
    enable_lean_forward(model, family_by_name(name))


@pytest.mark.parametrize("weights", ["float32", "int8", "int4", "bf16", "int8-blocks"])
@pytest.mark.parametrize("name", DENSE_ARCHITECTURES)
def test_native_decode_layer_equals_lean_operators(
    int4_dirs: dict[str, Path], name: str, weights: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """exo's decode layer (one C++ call per layer for decode-only steps: two requests, one
    past the sliding window) against the lean forward's torch operators on the same model,
    and, for float32 weights, against transformers: only the order of float32 sums differs
    (attention's softmax and weighted sum, the norms), so float32 logits agree to float32
    rounding (bfloat16-held weights too: their products are exact float32); int4 and int8
    kernels round activations to int16 blocks, where a last-bit difference can move a value
    by one step of 1/32767 of its block's largest, so those get a looser bound."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    held_as_float = weights in ("bf16", "int8-blocks")
    model = _load(int4_dirs[name], "float32" if held_as_float else weights)
    if weights == "bf16":
        _output_and_down_in_bf16(model, name)
    if weights == "int8-blocks":
        _held_as_scaled_int8(model, name)
    lean = lean_step_of(model)
    assert isinstance(lean, LeanModel)
    decode_layer = lean._decode_layer
    assert decode_layer is not None
    tokens = lean_steps.forced_tokens(VOCAB_PROBE)
    native_rows: list[int] = []
    run_layers = lean._decode_layers

    def counted(plan: BatchPlan, x: torch.Tensor, tables: Any) -> None:
        native_rows.append(x.shape[0])
        run_layers(plan, x, tables)

    monkeypatch.setattr(lean, "_decode_layers", counted)
    native = lean_steps.run_single(model, tokens, lean=True)
    # Every decode step ran natively, the last two with request C's prompt chunks beside A
    # and B (9 and 8 rows: the block weights' 512-bit tiles where built, else their integer
    # GEMM: decode_layer.cpp's bounds; the second chunk's later rows past the sliding
    # window); the prompt-only first step did not.
    first_chunk = lean_steps.PROMPT_C_FIRST_CHUNK
    assert native_rows == [2] * (lean_steps.DECODE_STEPS - 2) + [
        2 + first_chunk,
        2 + lean_steps.PROMPT_C_LENGTH - first_chunk,
    ]
    lean._decode_layer = None
    try:
        operators = lean_steps.run_single(model, tokens, lean=True)
    finally:
        lean._decode_layer = decode_layer
    tolerance = 2e-2 if weights in ("int8", "int4", "int8-blocks") else FLOAT32_TOLERANCE
    assert (native - operators).abs().max().item() < tolerance
    assert torch.equal(native.argmax(-1), operators.argmax(-1))
    if weights == "float32":
        reference = lean_steps.run_single(model, tokens, lean=False)
        assert (native - reference).abs().max().item() < FLOAT32_TOLERANCE
        assert torch.equal(native.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("activations", ["int16", "int8", "bf16"])
def test_mixed_step_is_native_where_prompt_rows_round_as_decode_rows(
    int4_dirs: dict[str, Path], activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with decode rows and a prompt chunk runs in exo's decode layer (int16
    activations for every row) only where the chunk's products would take int16 anyway:
    always with int16 prefill activations; with bf16 below its minimum rows beside decode
    rows, or at any length where bf16 does not run; never with int8."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    model = _load(int4_dirs["llama"], "int4")
    assert set_prefill_activations(model, activations) > 0  # type: ignore[arg-type]
    lean = lean_step_of(model)
    assert isinstance(lean, LeanModel) and lean._decode_layer is not None
    cache, windows, layer_of = lean_steps.new_cache(model)

    def native(chunk: int) -> bool:
        prefill = [PrefillSegment(1, 0, 1, chunk)] if chunk else []
        plan = BatchPlan(cache, windows, [0], [5], prefill, layer_of)
        return lean._native_step(plan, 1 + chunk)

    short, long = 7, 64
    assert lean._bf16_min_rows == 0 or short < lean._bf16_min_rows <= long
    assert native(0)  # decode only
    assert native(short) == (activations != "int8")
    bf16_runs = lean._bf16_prefill
    assert native(long) == (activations == "int16" or (activations == "bf16" and not bf16_runs))


def test_bf16_fallback_forced(tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With bfloat16 forced off (as on a CPU without it), activations stay float32 and the
    quantized kernels are called as transformers' path calls them: the same logits."""
    monkeypatch.setenv(direct_forward_parts.BF16_ENV, "0")
    monkeypatch.setenv(NATIVE_INT4_ENV, "0")
    model = _load(tiny_dirs["llama"], "int4")
    lean = lean_step_of(model)
    assert isinstance(lean, LeanModel) and not lean.bf16
    layer = lean.layers[0]
    assert layer.gate_up is not None and layer.qkv is not None
    assert layer.qkv.in_dtype == torch.float32 and layer.gate_up.in_dtype == torch.float32
    tokens = lean_steps.forced_tokens(VOCAB_PROBE)
    reference = lean_steps.run_single(model, tokens, lean=False)
    fallback = lean_steps.run_single(model, tokens, lean=True)
    assert (fallback - reference).abs().max().item() < 1e-3
    assert torch.equal(fallback.argmax(-1), reference.argmax(-1))
    monkeypatch.setenv(direct_forward_parts.BF16_ENV, "1")
    assert direct_forward_parts.bf16_activations_wanted()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_cached_rotary_tables_equal_the_rotary_module(
    tiny_dirs: dict[str, Path], name: str
) -> None:
    """The cached tables (blocks of positions, gathered per step) hold exactly the values the
    rotary module gives the step's own positions, across block boundaries and in any order;
    a span past the cache's limit is computed directly and not kept."""
    lean = lean_step_of(_load(tiny_dirs[name]))
    assert isinstance(lean, LeanModel)
    cache = lean._rotary_cache
    assert cache is not None  # every tiny model's rope type is static
    block = direct_forward_parts.ROTARY_BLOCK
    steps = [[0], [5], [block - 1, 3], [block], [block + 7, 2 * block + 1, 1], list(range(40))]
    for positions in steps:
        ids = torch.tensor(positions, dtype=torch.int64)
        cached = cache.tables(ids, torch.float32, CPU)
        computed = lean._computed_rotary_tables(ids, torch.float32, CPU)
        assert len(cached) == len(computed) == len(lean._rope_kinds)
        for (cos, sin, perm), (cos_ref, sin_ref, perm_ref) in zip(cached, computed, strict=True):
            assert cos.shape == cos_ref.shape == (len(positions), 1, lean.layers[0].head_dim)
            assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
            assert torch.equal(perm, perm_ref)
    kept = cache._tables
    far = torch.tensor([0, direct_forward_parts.ROTARY_CACHE_LIMIT + 5], dtype=torch.int64)
    for (cos, _, _), (cos_ref, _, _) in zip(
        cache.tables(far, torch.float32, CPU),
        lean._computed_rotary_tables(far, torch.float32, CPU),
        strict=True,
    ):
        assert torch.equal(cos, cos_ref)
    assert cache._tables is kept


def test_dynamic_rope_is_not_cached() -> None:
    """Rope types whose frequencies change with the longest position ("dynamic" NTK scaling,
    "longrope") are computed per step; the static ones (and Gemma 3's per-kind dict) are
    cached; a module that names no type is not."""
    module = nn.Module()
    for rope_type, static in [
        ("default", True), ("linear", True), ("yarn", True), ("llama3", True),
        ("dynamic", False), ("longrope", False),
    ]:  # fmt: skip
        module.rope_type = rope_type  # type: ignore[assignment]
        assert direct_forward_parts.static_rope(module, [None]) is static
    module.rope_type = {"full_attention": "default", "sliding_attention": "linear"}  # type: ignore[assignment]
    assert direct_forward_parts.static_rope(module, ["full_attention", "sliding_attention"])
    module.rope_type = {"full_attention": "dynamic", "sliding_attention": "default"}  # type: ignore[assignment]
    assert not direct_forward_parts.static_rope(module, ["full_attention", "sliding_attention"])
    assert not direct_forward_parts.static_rope(nn.Module(), [None])


def test_family_without_layout_keeps_transformers(tiny_dirs: dict[str, Path]) -> None:
    model = _load(tiny_dirs["llama"])
    model.__dict__["_exo_lean_step"] = None
    family = dataclasses.replace(family_by_name("llama"), layout=None)
    assert enable_lean_forward(model, family) is None
    assert lean_step_of(model) is None
    tokens = lean_steps.forced_tokens(VOCAB_PROBE)
    assert lean_steps.run_single(model, tokens, lean=False).shape[0] == 15


@pytest.mark.parametrize("kind", ["dense", "int4", "int4-native", "int8"])
def test_fused_linears_equal_parts_and_share_storage(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NATIVE_INT4_ENV, "1" if kind == "int4-native" else "0")
    torch.manual_seed(0)
    dense = [nn.Linear(64, width, bias=True) for width in (128, 64, 64)]
    expected = None
    parts: list[nn.Module] = list(dense)
    if kind.startswith("int4"):
        parts = [Int4Linear(linear) for linear in dense]
    elif kind == "int8":
        parts = [Int8Linear(linear) for linear in dense]
    rows = torch.randn(3, 64)
    with torch.inference_mode():
        expected = torch.cat([part(rows) for part in parts], dim=-1)
        fused = fuse_linears(parts)
        assert fused is not None
        assert torch.allclose(fused(rows), expected, atol=1e-5, rtol=0)
        # The parts still compute what they did, now reading the fused storage.
        assert torch.allclose(torch.cat([part(rows) for part in parts], -1), expected, atol=1e-5)
    storage = {
        "dense": lambda m: m.weight,
        "int4": lambda m: m.packed,
        "int4-native": lambda m: m.packed,
        "int8": lambda m: m.weight,
    }[kind]
    for part in parts:
        assert storage(part).untyped_storage().data_ptr() == (
            storage(fused).untyped_storage().data_ptr()
        )


def test_mixed_kinds_are_not_fused() -> None:
    torch.manual_seed(0)
    parts: list[nn.Module] = [Int4Linear(nn.Linear(64, 64)), Int8Linear(nn.Linear(64, 32))]
    assert fuse_linears(parts) is None
    groups: list[nn.Module] = [Int4Linear(nn.Linear(64, 64), 32), Int4Linear(nn.Linear(64, 64), 64)]
    assert fuse_linears(groups) is None


# -- sharded: 2 gloo ranks ---------------------------------------------------------------


def _rank_main(
    rank: int, world_size: int, port: int, results: Any, model_dir: str, modes: tuple[str, ...]
) -> None:
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group

    torch.set_num_threads(1)
    try:
        init_group("gloo", rank, 2, "127.0.0.1", port, timeout_s=60)
        tokens = lean_steps.forced_tokens(VOCAB_PROBE)
        for mode in modes:
            shard = make_shard(Path(model_dir), mode, rank, 2)
            model = load_model(Path(model_dir), shard, CPU, "float32")
            assert isinstance(lean_step_of(model), LeanModel), "no lean forward on a rank"
            for lean in (True, False):
                if mode == "pipeline":
                    logits = lean_steps.run_pipeline_rank(model, tokens, lean, rank, 2)
                else:  # tensor ranks split the KV heads, expert ranks hold them all
                    heads_split = 2 if mode == "tensor" else 1
                    logits = lean_steps.run_single(model, tokens, lean, world_size=heads_split)
                if logits is not None and (mode != "pipeline") == (rank == 0):
                    results.put(("logits", (mode, lean), logits.numpy()))  # no shared memory
        results.put(("done", rank, None))
        destroy_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


SHARDED_PARAMS = [
    pytest.param(name, marks=() if name == "llama" else pytest.mark.slow, id=name)
    for name in ARCHITECTURES
]


@pytest.mark.parametrize("name", SHARDED_PARAMS)
def test_sharded_lean_equals_transformers(tiny_dirs: dict[str, Path], name: str) -> None:
    model_dir = tiny_dirs[name]
    reference = lean_steps.run_single(
        _load(model_dir), lean_steps.forced_tokens(VOCAB_PROBE), False
    )
    # Mixture-of-experts families are split by their experts too.
    modes = ("pipeline", "tensor") + (("expert",) if family_by_name(name).moe else ())
    reports = run_rank_processes(_rank_main, (str(model_dir), modes), 2, GROUP_DEADLINE_S)
    collected: dict[tuple[str, bool], torch.Tensor] = {
        key: torch.from_numpy(value) for kind, key, value in reports if kind == "logits"
    }
    assert set(collected) == {(mode, lean) for mode in modes for lean in (True, False)}
    for (mode, lean), logits in collected.items():
        difference = (logits - reference).abs().max().item()
        assert difference < FLOAT32_TOLERANCE, (mode, lean, difference)
        assert torch.equal(logits.argmax(-1), reference.argmax(-1)), (mode, lean)


@pytest.fixture(autouse=True)
def _no_group_in_test_process() -> Any:
    yield
    assert not torch.distributed.is_initialized()


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Tiny matmuls run faster on one thread than contending for two busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
