"""gpt-oss through the engine's real step against transformers' own implementation: a tiny
random-weight `GptOssForCausalLM` (sliding and full attention layers alternating, attention
sinks and biases, YaRN rope, a biased router choosing 2 of 4 experts, biased experts with
the clamped SwiGLU, the checkpoint's stacked expert tensors) gives float32 logits within
`FLOAT32_TOLERANCE` over a 64-token prompt and 16 greedy steps, on the lean forward and on
transformers' modules with the engine's `RoutedExperts`, with no routing decision near a
tie; requests routed to disjoint experts decode the same batched as alone.

The sharded checks (pipeline x2, tensor x2, expert x2 and x3) run for `gpt_oss` with every
family (`test_distributed.py`), as do the loader, lean-forward and batching checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from exo.testing.tiny_models import save_mxfp4_twin, save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import attach_lean_step, lean_step_of
from exo.worker.engines.torch.batching.prefill_attention import sink_attention
from exo.worker.engines.torch.comm.parallel_linears import VocabParallelHead
from exo.worker.engines.torch.model.direct_forward import LeanModel
from exo.worker.engines.torch.model.direct_forward_moe import NativeMxfp4Experts
from exo.worker.engines.torch.model.families import family_by_name
from exo.worker.engines.torch.model.families.gpt_oss import clamped_swiglu
from exo.worker.engines.torch.model.fused_experts import FusedExperts
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.model.moe import routed_experts_of
from exo.worker.engines.torch.quant.mxfp4 import (
    NATIVE_MAX_ROWS,
    Mxfp4Linear,
    dequantize_mxfp4,
    mxfp4_int8_blocks,
    mxfp4_linear,
    quantize_mxfp4,
)
from exo.worker.engines.torch.quant.native_kernels import (
    NATIVE_INT4_ENV,
    ROUNDS_ACTIVATIONS,
    native_int4_kernel,
    rounded_activations,
)
from exo.worker.engines.torch.tests.test_distributed import make_shard
from exo.worker.engines.torch.tests.test_moe import (
    FLOAT32_TOLERANCE,
    GREEDY_STEPS,
    PROMPT_LENGTH,
    _prompt,
    _run,
    engine_greedy,
)

CPU = torch.device("cpu")
FAMILY = family_by_name("gpt_oss")
LAYERS = 4  # sliding, full, sliding, full
# Largest relative error of a MoE block's output with MXFP4 experts against the float
# experts they were quantized from (E2M1 values, one power-of-two scale per 32 inputs:
# about 0.1 per weight; measured on the tiny model: see the test's output).
MXFP4_BLOCK_ERROR = 0.2


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    return save_tiny_model(
        tmp_path_factory.mktemp("gpt-oss"), "gpt_oss", real_model_dir, n_layers=LAYERS,
        tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(gpt_oss_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        gpt_oss_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _load(model_dir: Path) -> Any:
    return load_model(model_dir, make_shard(model_dir, "pipeline", 0, 1), CPU, "float32")


def routing_margins(reference: Any, ids: list[int]) -> tuple[float, dict[int, set[int]]]:
    """Transformers' own gpt-oss routers over `ids`: the smallest gap between a token's
    k-th and (k+1)-th router logit in any layer, and the experts chosen per layer."""
    recorded: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(reference.model.layers):

        def keep(_module: Any, _inputs: Any, output: Any, index: int = index) -> None:
            recorded[index] = output[0].detach()  # router logits [T, experts]

        hooks.append(layer.mlp.router.register_forward_hook(keep))
    try:
        with torch.no_grad():
            reference(input_ids=torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    k = int(reference.config.num_experts_per_tok)
    margin = float("inf")
    chosen: dict[int, set[int]] = {}
    for index, logits in recorded.items():
        scores = logits.float().sort(dim=-1, descending=True)
        margin = min(margin, float((scores.values[:, k - 1] - scores.values[:, k]).min()))
        chosen[index] = set(scores.indices[:, :k].flatten().tolist())
    return margin, chosen


def _experts_of_repeated_tokens(reference: Any, tokens: int) -> dict[int, dict[int, set[int]]]:
    """Per token id below `tokens`: the experts each layer routes a 4-token prompt of it
    to (transformers' routers, all prompts in one batch)."""
    recorded: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(reference.model.layers):

        def keep(_module: Any, _inputs: Any, output: Any, index: int = index) -> None:
            recorded[index] = output[0].detach()

        hooks.append(layer.mlp.router.register_forward_hook(keep))
    try:
        with torch.no_grad():
            reference(input_ids=torch.arange(tokens)[:, None].expand(tokens, 4))
    finally:
        for hook in hooks:
            hook.remove()
    k = int(reference.config.num_experts_per_tok)
    return {
        token: {
            index: set(logits.view(tokens, 4, -1)[token].topk(k).indices.flatten().tolist())
            for index, logits in recorded.items()
        }
        for token in range(tokens)
    }


@pytest.mark.parametrize("path", ["lean", "transformers"])
def test_gpt_oss_equals_transformers(gpt_oss_dir: Path, reference: Any, path: str) -> None:
    config = reference.config
    assert config.layer_types == ["sliding_attention", "full_attention"] * (LAYERS // 2)
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.sliding_window < PROMPT_LENGTH  # the window cuts the prompt
    _assert_equals_transformers(_load(gpt_oss_dir), reference, path)


def _assert_equals_transformers(model: Any, reference: Any, path: str) -> None:
    """The engine's step on `model` (its lean forward, or transformers' modules with the
    engine's experts and attention) gives `reference`'s float32 logits within the
    tolerance over the prompt and the greedy steps, with no routing decision near a tie."""
    lean = lean_step_of(model)
    assert isinstance(lean, LeanModel)
    assert all(layer.moe is not None and layer.sinks is not None for layer in lean.layers)
    assert all(routed_experts_of(layer, FAMILY) is not None for layer in model.model.layers)
    if path == "transformers":  # transformers' modules, the engine's experts and attention
        attach_lean_step(model, None)
    config = reference.config
    prompt = _prompt()
    ours, tokens = engine_greedy(model, prompt)
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor([prompt + tokens])).logits[0]
    assert ours.shape == theirs.shape == (PROMPT_LENGTH + GREEDY_STEPS, config.vocab_size)
    difference = float((ours - theirs).abs().max())
    margin, chosen = routing_margins(reference, prompt + tokens)
    print(f"{path}: max |engine - transformers| logit {difference:.3g}, margin {margin:.3g}")
    assert difference < FLOAT32_TOLERANCE
    assert theirs[PROMPT_LENGTH - 1 : -1].argmax(-1).tolist() == tokens
    assert margin > FLOAT32_TOLERANCE
    experts = int(config.num_local_experts)
    assert all(used == set(range(experts)) for used in chosen.values())  # every expert ran


def test_sinks_matter(gpt_oss_dir: Path, reference: Any) -> None:
    """The sinks are not a no-op in the tiny model: zeroing them moves the logits far more
    than the tolerance (so the equality above checks them)."""
    prompt = _prompt()
    with torch.no_grad():
        before = reference(input_ids=torch.tensor([prompt])).logits[0]
        saved = [layer.self_attn.sinks.clone() for layer in reference.model.layers]
        for layer in reference.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        after = reference(input_ids=torch.tensor([prompt])).logits[0]
        for layer, sinks in zip(reference.model.layers, saved, strict=True):
            layer.self_attn.sinks.copy_(sinks)
    assert float((before - after).abs().max()) > 100 * FLOAT32_TOLERANCE


def test_requests_on_disjoint_experts_decode_the_same_batched_as_alone(
    gpt_oss_dir: Path, reference: Any
) -> None:
    """Two requests whose tokens route to disjoint experts in as many layers as any pair
    of repeated-token prompts does (a sink makes a repeated token's attention output, so
    its routing, depend on the position: all four layers disjoint is rare with 4 experts)."""
    used = _experts_of_repeated_tokens(reference, 64)

    def disjoint_layers(pair: tuple[int, int]) -> int:
        first, second = used[pair[0]], used[pair[1]]
        return sum(not first[i] & second[i] for i in first)

    pair = max(
        ((first, second) for first in range(64) for second in range(first + 1, 64)),
        key=disjoint_layers,
    )
    assert disjoint_layers(pair) >= 2
    model = _load(gpt_oss_dir)
    requests = [[pair[0]] * 9, [pair[1]] * 6]
    alone = [_run(model, [request], 4)[0] for request in requests]
    batched = _run(model, requests, 4)
    mixed = _run(model, [*requests, _prompt(1)[:7]], 4)[:2]
    for solo, together, beside in zip(alone, batched, mixed, strict=True):
        assert float((solo - together).abs().max()) < FLOAT32_TOLERANCE
        assert float((solo - beside).abs().max()) < FLOAT32_TOLERANCE


def test_sink_attention_equals_transformers_eager() -> None:
    """`sink_attention` against transformers' gpt-oss eager attention (grouped heads,
    a causal mask, sinks of both signs)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 6, 5, 8, generator=generator)
    key, value = (torch.randn(1, 2, 7, 8, generator=generator) for _ in range(2))
    sinks = torch.tensor([-2.0, 0.0, 1.0, 3.0, 0.5, -0.5])
    visible = torch.ones(5, 7, dtype=torch.bool).tril(2)
    additive = torch.zeros(5, 7).masked_fill(~visible, float("-inf"))[None, None]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=3, training=False)
    theirs, _ = eager_attention_forward(module, query, key, value, additive, scaling=0.3)  # type: ignore[arg-type]
    ours = sink_attention(query, key, value, visible, 0.3, sinks=sinks)
    assert torch.allclose(ours.transpose(1, 2), theirs, atol=1e-6)


def test_prefill_with_sinks_in_small_query_blocks_equals_one_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt chunk whose scores would pass `SINK_SCORE_ELEMENTS` attends in smaller
    query blocks, with the same result (sliding window and full)."""
    from exo.worker.engines.torch.batching import prefill_attention

    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(1, 4, 40, 8, generator=generator)
    keys, values = (torch.randn(1, 2, 50, 8, generator=generator) for _ in range(2))
    sinks = torch.tensor([-1.0, 0.0, 1.0, 2.0])
    for window in (None, 6):
        whole = prefill_attention.prefill_attention(
            queries, keys, values, 10, window, 0.3, None, sinks
        )
        monkeypatch.setattr(prefill_attention, "SINK_SCORE_ELEMENTS", 4 * 50 * 3)  # 3 queries
        blocks = prefill_attention.prefill_attention(
            queries, keys, values, 10, window, 0.3, None, sinks
        )
        monkeypatch.undo()
        assert torch.allclose(blocks, whole, atol=1e-6)


def test_clamped_swiglu_equals_transformers_experts() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2)
    gate_up = torch.randn(40, 12, generator=torch.Generator().manual_seed(0)) * 6
    theirs = GptOssExperts(config)._apply_gate(gate_up)
    ours = clamped_swiglu(config)(gate_up[:, 0::2], gate_up[:, 1::2])
    assert torch.equal(ours, theirs)


def test_fused_expert_tensors_cut_per_expert() -> None:
    """`gate_up_proj` `[experts, hidden, 2 * intermediate]` (gate / up interleaved) and
    `down_proj` `[experts, intermediate, hidden]` cut into each expert's `[out, in]`
    linears; only that expert's rows are read."""
    assert FAMILY.moe is not None
    fused = FusedExperts(FAMILY.moe, experts=3)
    stacked = torch.randn(3, 4, 10)  # hidden 4, intermediate 5
    names = fused.targets("model.layers.2.mlp.experts.gate_up_proj")
    assert (
        names[:2]
        == [
            "model.layers.2.mlp.experts.0.gate_proj.weight",
            "model.layers.2.mlp.experts.0.up_proj.weight",
        ]
        and len(names) == 6
    )
    assert fused.targets("model.layers.2.mlp.experts.down_proj_bias")[1] == (
        "model.layers.2.mlp.experts.1.down_proj.bias"
    )
    assert fused.targets("model.layers.2.self_attn.sinks") == ["model.layers.2.self_attn.sinks"]
    read: list[Any] = []

    class Stored:
        def get_shape(self) -> list[int]:
            return list(stacked.shape)

        def __getitem__(self, index: Any) -> torch.Tensor:
            read.append(index)
            return stacked[index]

    up = fused.cut("x.gate_up_proj", "model.layers.2.mlp.experts.1.up_proj.weight", Stored())
    assert torch.equal(up[:], stacked[1, :, 1::2].T) and read == [slice(1, 2)]
    gate = fused.cut("x.gate_up_proj", "model.layers.2.mlp.experts.2.gate_proj.weight", Stored())
    assert torch.equal(gate[:], stacked[2, :, 0::2].T)


def test_tiny_model_clamps_bind(reference: Any) -> None:
    """Some gate / up values of the tiny model pass `swiglu_limit`, so the equality test
    checks the clamps too."""
    limit = float(reference.config.swiglu_limit)
    largest: list[float] = []
    experts = [layer.mlp.experts for layer in reference.model.layers]
    originals = [module._apply_gate for module in experts]

    def recording(original: Any) -> Any:
        def apply_gate(gate_up: torch.Tensor) -> torch.Tensor:
            largest.append(float(gate_up.abs().max()))
            return original(gate_up)

        return apply_gate

    try:
        for module, original in zip(experts, originals, strict=True):
            module._apply_gate = recording(original)
        with torch.no_grad():
            reference(input_ids=torch.tensor([_prompt()]))
    finally:
        for module, original in zip(experts, originals, strict=True):
            module._apply_gate = original
    assert max(largest) > limit


# -- MXFP4 experts (the checkpoint's `quantization_config.quant_method = "mxfp4"`) -----------


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory: pytest.TempPathFactory, gpt_oss_dir: Path) -> Path:
    return save_mxfp4_twin(gpt_oss_dir, tmp_path_factory.mktemp("gpt-oss-mxfp4"))


@pytest.mark.parametrize("path", ["lean", "transformers"])
def test_mxfp4_experts_equal_transformers_dequantized(
    mxfp4_dir: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experts held as MXFP4 (uint8 blocks and scales, widened per expert per call:
    exo's fused kernel, which rounds activations to int16 blocks, is turned off here and
    checked on its own below) give transformers' logits for the same checkpoint
    dequantized at load (its own MXFP4 reader, `Mxfp4Config(dequantize=True)`) within the
    float32 tolerance: MXFP4 values are exact in float32, so only the order of float32
    operations differs."""
    from transformers.utils.quantization_config import Mxfp4Config

    monkeypatch.setenv(NATIVE_INT4_ENV, "0")

    model = _load(mxfp4_dir)
    for layer in model.model.layers:
        experts = routed_experts_of(layer, FAMILY)
        assert experts is not None and experts.expert_format == "mxfp4"
        for expert in experts.held().values():
            for linear in (expert.gate_proj, expert.up_proj, expert.down_proj):
                assert isinstance(linear, Mxfp4Linear)
                assert linear.blocks.dtype == linear.scales.dtype == torch.uint8
    reference = AutoModelForCausalLM.from_pretrained(
        mxfp4_dir, dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True),
    ).eval()  # fmt: skip
    _assert_equals_transformers(model, reference, path)


def test_mxfp4_moe_block_relative_error(gpt_oss_dir: Path, mxfp4_dir: Path) -> None:
    """A MoE block with MXFP4 experts against the float experts they were quantized from
    (the same routing: the router stays float32), on RMS-normed random rows; and the
    experts' bytes held (4.25 bits per weight plus float32 biases)."""
    float_moe, mxfp4_moe = (lean_step_of(_load(d)).layers[0].moe for d in (gpt_oss_dir, mxfp4_dir))  # type: ignore[union-attr]
    assert float_moe is not None and mxfp4_moe is not None
    rows = torch.nn.functional.rms_norm(
        torch.randn(256, 64, generator=torch.Generator().manual_seed(0)), (64,)
    )
    with torch.inference_mode():
        expected, got = float_moe(rows), mxfp4_moe(rows)
    error = float((got - expected).norm() / expected.norm())
    print(f"MXFP4 MoE block relative error {error:.3g}")
    assert 0 < error < MXFP4_BLOCK_ERROR


def test_mxfp4_moe_block_runs_its_experts_in_one_native_call(mxfp4_dir: Path) -> None:
    """Where exo's kernels run, the lean forward's MoE block of the MXFP4 checkpoint takes
    the native experts call (`NativeMxfp4Experts`), the per-expert path's output bit for
    bit (decode rows and a prompt's; the call itself: test_moe_mxfp4_native.py)."""
    if native_int4_kernel() is None:
        pytest.skip("exo's native kernels are not built here")
    moe = lean_step_of(_load(mxfp4_dir)).layers[0].moe  # type: ignore[union-attr]
    assert moe is not None and isinstance(moe.native, NativeMxfp4Experts)
    native = moe.native
    generator = torch.Generator().manual_seed(1)
    for count in (1, 200):
        rows = torch.nn.functional.rms_norm(torch.randn(count, 64, generator=generator), (64,))
        moe.native = native
        with torch.inference_mode():
            got = moe(rows)
            moe.native = None
            assert torch.equal(got, moe(rows))


def test_mxfp4_expert_rank_holds_only_its_experts(mxfp4_dir: Path) -> None:
    """Rank 1 of 2 expert-parallel ranks loads experts 2 and 3 of each layer, as MXFP4,
    equal to the checkpoint's (each cut from the stacked tensors' rows)."""
    from safetensors.torch import load_file

    model = load_model(mxfp4_dir, make_shard(mxfp4_dir, "expert", 1, 2), CPU, "float32")
    stored = load_file(str(mxfp4_dir / "model.safetensors"))
    for index, layer in enumerate(model.model.layers):
        experts = routed_experts_of(layer, FAMILY)
        assert experts is not None and sorted(experts.held()) == [2, 3]
        name = f"model.layers.{index}.mlp.experts.gate_up_proj"
        up: Any = experts.held()[3].up_proj
        assert torch.equal(up.blocks, stored[f"{name}_blocks"][3, 1::2])
        assert torch.equal(up.scales, stored[f"{name}_scales"][3, 1::2])


def test_expert_ranks_split_the_lm_head_by_vocabulary(mxfp4_dir: Path) -> None:
    """Expert-parallel ranks hold their rows of the LM head (`VocabParallelHead`, as tensor
    ranks do), together the whole head: a rank reads half the head per token instead of
    all of it (the logits are gathered; test_distributed checks the tokens equal)."""
    from safetensors.torch import load_file

    stored = load_file(str(mxfp4_dir / "model.safetensors"))["lm_head.weight"]
    rows: list[torch.Tensor] = []
    for rank in range(2):
        model = load_model(mxfp4_dir, make_shard(mxfp4_dir, "expert", rank, 2), CPU, "float32")
        head: Any = model.lm_head
        assert isinstance(head, VocabParallelHead) and head.vocab == stored.shape[0]
        assert head.start == sum(len(part) for part in rows)
        local: Any = head.local
        rows.append(local.weight.detach())
    assert 0 < len(rows[1]) <= len(rows[0]) < stored.shape[0]
    assert torch.equal(torch.cat(rows), stored)


@pytest.mark.parametrize("rows", [1, 3, 4, 9, NATIVE_MAX_ROWS])
@pytest.mark.parametrize(("outputs", "inputs"), [(7, 96), (64, 64), (130, 2880)])
def test_fused_mxfp4_kernel_equals_the_product_of_its_rounded_activations(
    rows: int, outputs: int, inputs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """exo's fused MXFP4 kernel (`native/mxfp4.cpp`, forced on) against the exact product
    of the dequantized weight: on x86 with AVX2 it rounds the activations to int16 per block
    of 32 (`rounded_activations`) and sums the products exactly, so it equals the float32
    product of those rounded rows up to float32 summation order; the portable loop equals
    the product of the rows themselves. Row counts cover the kernel's register tiles of 4,
    3, 2 and 1 rows and odd output counts its tiles of output rows."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    if native_int4_kernel() is None:
        pytest.skip("exo's native kernels could not be built here")
    generator = torch.Generator().manual_seed(rows * 1000 + outputs)
    blocks, scales = quantize_mxfp4(torch.randn(outputs, inputs, generator=generator) * 0.02)
    x = torch.randn(rows, inputs, generator=generator)
    got = mxfp4_linear(x, blocks, scales)
    read = rounded_activations(x) if ROUNDS_ACTIVATIONS else x
    expected = read.double() @ dequantize_mxfp4(blocks, scales).double().T
    scale = float(expected.abs().max())
    assert float((got.double() - expected).abs().max()) <= 1e-6 * scale
    # And within the activations' rounding of the exact product (relative, ~1e-5).
    exact = x.double() @ dequantize_mxfp4(blocks, scales).double().T
    assert float((got.double() - exact).abs().max()) <= 1e-4 * scale


@pytest.mark.parametrize(
    ("scale_bytes", "magnitude"),
    [((0, 1, 2), 1e30), ((126, 127, 128, 129), 1.0), ((253, 254), 1e-30)],
)
def test_fused_mxfp4_kernel_reads_every_scale_byte(
    scale_bytes: tuple[int, ...], magnitude: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's pair tile (`native/mxfp4.cpp`, rows of whole pairs of blocks) turns 8
    scale bytes at a time into floats by their bits, not by the table: e8m0's ends (the
    kernel's doubled-value scales 2 ** (s - 128) are float32 subnormals for bytes 0 and 1,
    2 ** 126 for 254; 255 is e8m0's NaN, which no checkpoint holds) must be exact. Activations
    scaled so the products stay finite and far from float32's underflow; more pairs (9) than
    one step of 4 so both the vector and the scalar unpacking run."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    if native_int4_kernel() is None:
        pytest.skip("exo's native kernels could not be built here")
    generator = torch.Generator().manual_seed(len(scale_bytes))
    outputs, inputs = 6, 18 * 32
    blocks, scales = quantize_mxfp4(torch.randn(outputs, inputs, generator=generator))
    choice = torch.randint(0, len(scale_bytes), scales.shape, generator=generator)
    scales = torch.tensor(scale_bytes, dtype=torch.uint8)[choice]
    x = torch.randn(2, inputs, generator=generator) * magnitude
    got = mxfp4_linear(x, blocks, scales)
    read = rounded_activations(x) if ROUNDS_ACTIVATIONS else x
    # The weight in float64 (its float32 dequantization overflows at byte 254's 2 ** 127).
    values = dequantize_mxfp4(blocks, torch.full_like(scales, 127)).double()  # E2M1 values
    weight = values * torch.exp2(scales.double() - 127).repeat_interleave(32, dim=1)
    expected = read.double() @ weight.T
    assert torch.isfinite(got).all()
    assert float((got.double() - expected).abs().max()) <= 1e-6 * float(expected.abs().max())


def test_fused_mxfp4_kernel_rows_equal_each_row_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each activation row of a fused MXFP4 product is bit for bit what the kernel gives that
    row alone, whatever rows share the call (1-`NATIVE_MAX_ROWS`: the register tiles of 4, 3,
    2 and 1 rows, the folded one-row scales): batched decoding equals decoding alone, and a
    speculative verify step's rows equal decode steps'."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    if native_int4_kernel() is None:
        pytest.skip("exo's native kernels could not be built here")
    generator = torch.Generator().manual_seed(11)
    for inputs in (2880, 96):  # whole pairs of blocks (the pair tile), and an odd block
        blocks, scales = quantize_mxfp4(torch.randn(70, inputs, generator=generator) * 0.02)
        x = torch.randn(NATIVE_MAX_ROWS, inputs, generator=generator)
        alone = torch.cat([mxfp4_linear(x[row : row + 1], blocks, scales) for row in range(len(x))])
        for rows in (2, 3, 5, NATIVE_MAX_ROWS):
            assert torch.equal(mxfp4_linear(x[:rows], blocks, scales), alone[:rows]), (inputs, rows)


def test_mxfp4_as_int8_blocks_is_the_same_weight() -> None:
    """`mxfp4_int8_blocks`: doubled E2M1 integers times `2 ** (s - 128)` are the MXFP4
    weight bit for bit, scales at both ends of e8m0's range included."""
    generator = torch.Generator().manual_seed(3)
    blocks, scales = quantize_mxfp4(torch.randn(16, 96, generator=generator))
    scales[0, 0], scales[1, 1] = 0, 254  # 2**-127 and 2**127
    values, block_scales = mxfp4_int8_blocks(blocks, scales)
    assert values.dtype == torch.int8 and int(values.abs().max()) <= 12
    widened = values.float().view(16, 3, 32) * block_scales.float().unsqueeze(-1)
    assert torch.equal(widened.view(16, 96), dequantize_mxfp4(blocks, scales))


@pytest.mark.parametrize("rows", [NATIVE_MAX_ROWS + 1, 96])
def test_many_rows_take_the_int8_block_product_of_the_rounded_activations(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `NATIVE_MAX_ROWS` (an expert's rows of a prompt chunk) the blocks go to exo's
    prefill GEMM as int8 blocks: the product of the int16-rounded rows with the exact
    weight, as the fused kernel's."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    if native_int4_kernel() is None:
        pytest.skip("exo's native kernels could not be built here")
    generator = torch.Generator().manual_seed(rows)
    blocks, scales = quantize_mxfp4(torch.randn(130, 2880, generator=generator) * 0.02)
    x = torch.randn(rows, 2880, generator=generator)
    got = mxfp4_linear(x, blocks, scales)
    weight = dequantize_mxfp4(blocks, scales).double()
    exact = x.double() @ weight.T
    scale = float(exact.abs().max())
    assert float((got.double() - exact).abs().max()) <= 1e-4 * scale
    read = rounded_activations(x) if ROUNDS_ACTIVATIONS else x
    assert float((got.double() - read.double() @ weight.T).abs().max()) <= 1e-5 * scale


def test_fused_mxfp4_kernel_names_a_wrong_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    if native_int4_kernel() is None:
        pytest.skip("exo's native kernels could not be built here")
    blocks, scales = quantize_mxfp4(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="x has 32 inputs, blocks 64"):
        torch.ops.exo_native.mxfp4_gemv(torch.randn(1, 32), blocks, scales)


def test_mxfp4_round_trip() -> None:
    """`quantize_mxfp4` then `dequantize_mxfp4`: exact for values already on the MXFP4
    grid, and within E2M1's rounding for random ones (relative error about 0.1)."""
    grid = torch.tensor([0.5, -1.5, 6.0, 3.0] * 8) * 2.0**-3  # one block
    blocks, scales = quantize_mxfp4(grid[None])
    assert torch.equal(dequantize_mxfp4(blocks, scales)[0], grid)
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    error = dequantize_mxfp4(*quantize_mxfp4(weight)) - weight
    assert float(error.norm() / weight.norm()) < 0.15


@pytest.mark.slow
def test_mxfp4_tensor_and_expert_splits_equal_single_process(mxfp4_dir: Path) -> None:
    """MXFP4 experts split by tensor ranks (whole blocks of each expert's down projection's
    inputs) and by expert ranks (2 of 4 experts each) give the single process's greedy and
    seeded tokens."""
    from exo.worker.engines.torch.tests.test_distributed import (
        GREEDY,
        SEEDED,
        Job,
        run_group,
        single_process_tokens,
    )

    expected = single_process_tokens(mxfp4_dir, (GREEDY, SEEDED))
    results = run_group(
        2,
        [
            Job("tensor", str(mxfp4_dir), "tensor", (GREEDY, SEEDED)),
            Job("expert", str(mxfp4_dir), "expert", (GREEDY, SEEDED)),
        ],
    )
    assert results["tensor"].tokens == expected
    assert results["expert"].tokens == expected
