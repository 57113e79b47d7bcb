"""Mixture-of-experts models through the engine's real step against transformers' own
implementation: tiny random-weight Qwen3-MoE models (top-k of several experts, dense
`mlp_only_layers` and `decoder_sparse_step` layers) give float32 logits within
`FLOAT32_TOLERANCE` over a 64-token prompt and 16 greedy steps, with no routing decision
near a tie; requests routed to disjoint experts give the same logits batched as alone; the
routing function equals transformers' routers (Qwen3-MoE's softmax, DeepSeek-V3's sigmoid
with correction bias and group-limited choice).

The sharded checks (pipeline x2, tensor x2) and the registry-wide ones (loader, lean
forward, batching) run for `qwen3_moe` with every family (`test_distributed.py`,
`test_lean_forward.py`, `test_batching.py`, `test_families.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from exo.shared.models.cards import card_from_local_directory
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    forward_batch,
    lean_step_of,
)
from exo.worker.engines.torch.model.direct_forward import LeanModel
from exo.worker.engines.torch.model.families import family_by_name
from exo.worker.engines.torch.model.families.spec import Routing, UnsupportedArchitectureError
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.model.moe import RoutedExperts, dispatch, route, routed_experts_of
from exo.worker.engines.torch.quant.int4_groups import Int4Linear
from exo.worker.engines.torch.tests.lean_steps import new_cache
from exo.worker.engines.torch.tests.test_distributed import make_shard

CPU = torch.device("cpu")
# Largest |engine - transformers| float32 logit allowed (the bound); the routing
# margins must exceed it, so a flipped expert choice can neither pass nor fail by chance.
FLOAT32_TOLERANCE = 1e-4
PROMPT_LENGTH = 64
GREEDY_STEPS = 16
VOCAB_PROBE = 1000  # prompt token ids are drawn below this

# Two tiny Qwen3-MoE shapes: top 2 of 4 experts renormalized (as Qwen3-30B-A3B's
# `norm_topk_prob`) with layer 1 dense (`mlp_only_layers`); top 3 of 8 not renormalized
# with every other layer dense (`decoder_sparse_step` 2: layers 1 and 3 sparse).
CONFIGS: dict[str, dict[str, Any]] = {
    "mlp-only-layers": {"num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1]},
    "sparse-step": {
        "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": False,
        "decoder_sparse_step": 2, "mlp_only_layers": [],
    },
}  # fmt: skip
SPARSE_LAYERS = {"mlp-only-layers": [0, 2, 3], "sparse-step": [1, 3]}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    return {
        name: save_tiny_model(
            tmp_path_factory.mktemp(f"moe-{name}"),
            "qwen3_moe",
            real_model_dir,
            n_layers=4,
            tie_word_embeddings=False,
            **overrides,
        )
        for name, overrides in CONFIGS.items()
    }


def _load(model_dir: Path) -> Any:
    return load_model(model_dir, make_shard(model_dir, "pipeline", 0, 1), CPU, "float32")


def _prompt(seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_PROBE, (PROMPT_LENGTH,), generator=generator).tolist()


def engine_greedy(model: Any, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The prompt prefilled in one step (logits of every prompt row), then `GREEDY_STEPS`
    decode steps each fed the previous greedy token: `[64 + 16, vocab]` logits and the 16
    tokens fed."""
    cache, windows, layer_of = new_cache(model)
    slot = cache.allocate()
    plan = BatchPlan(cache, windows, [], [], [PrefillSegment(slot, 0, 0, len(prompt))], layer_of)
    rows = torch.arange(len(prompt))
    positions = torch.arange(len(prompt))[None]
    logits = [forward_batch(model, plan, torch.tensor([prompt]), positions, rows)]
    tokens: list[int] = []
    for position in range(len(prompt), len(prompt) + GREEDY_STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        plan = BatchPlan(cache, windows, [slot], [position], [], layer_of)
        ids, where = torch.tensor([[tokens[-1]]]), torch.tensor([[position]])
        logits.append(forward_batch(model, plan, ids, where, torch.tensor([0])))
    return torch.cat(logits), tokens


def routing_margins(reference: Any, ids: list[int]) -> tuple[float, dict[int, set[int]]]:
    """Transformers' own routers over `ids`: the smallest gap between a token's k-th and
    (k+1)-th router logit in any MoE layer, and the experts chosen per layer. (Logits, not
    softmax scores: the ranking is the same, and an error of the router's inputs moves
    logits by about as much whatever their size, while the scores of experts far below the
    top one are tiny and so are their gaps.)"""
    recorded: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(reference.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):

            def keep(_module: Any, _inputs: Any, output: Any, index: int = index) -> None:
                recorded[index] = output[0].detach()  # router logits [T, experts]

            hooks.append(gate.register_forward_hook(keep))
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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_qwen3_moe_equals_transformers(moe_dirs: dict[str, Path], name: str) -> None:
    model = _load(moe_dirs[name])
    lean = lean_step_of(model)
    assert isinstance(lean, LeanModel)
    # Sparse layers where transformers put them, the rest dense; decode steps run every
    # layer's attention in exo's decode layer (a sparse layer's up to its output projection,
    # its experts after), so the comparison below covers that path too.
    family = family_by_name("qwen3_moe")
    sparse = [i for i, layer in enumerate(model.model.layers) if routed_experts_of(layer, family)]
    assert sparse == SPARSE_LAYERS[name]
    # The card placement sizes memory with (read from config.json without transformers)
    # says the same.
    card = card_from_local_directory(moe_dirs[name])
    assert card.moe is not None and card.moe.experts == CONFIGS[name]["num_experts"]
    dense = [i for i in range(card.n_layers) if i not in sparse]
    assert list(card.moe.dense_layers) == dense
    assert [i for i, layer in enumerate(lean.layers) if layer.moe is not None] == sparse
    assert lean._decode_layer is not None
    assert all(
        (layer.attention_arguments is not None) == (layer.moe is not None)
        and (layer.decode_arguments is None) == (layer.moe is not None)
        for layer in lean.layers
    )
    reference = AutoModelForCausalLM.from_pretrained(moe_dirs[name], dtype=torch.float32).eval()
    prompt = _prompt()
    ours, tokens = engine_greedy(model, prompt)
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor([prompt + tokens])).logits[0]
    vocab = int(reference.config.vocab_size)
    assert ours.shape == theirs.shape == (PROMPT_LENGTH + GREEDY_STEPS, vocab)
    difference = float((ours - theirs).abs().max())
    margin, chosen = routing_margins(reference, prompt + tokens)
    print(
        f"{name}: max |engine - transformers| logit {difference:.3g}, routing margin {margin:.3g}"
    )
    assert difference < FLOAT32_TOLERANCE
    # Transformers' own greedy choice at every step is the token the engine fed next.
    assert theirs[PROMPT_LENGTH - 1 : -1].argmax(-1).tolist() == tokens
    assert margin > FLOAT32_TOLERANCE
    experts = int(reference.config.num_experts)
    assert all(used == set(range(experts)) for used in chosen.values())  # every expert ran


def _disjoint_tokens(reference: Any) -> tuple[int, int, dict[int, tuple[set[int], set[int]]]]:
    """Two token ids whose repeated prompts route to disjoint experts in every MoE layer (a
    prompt of one repeated token has the same hidden state at every position, so it uses
    exactly top-k experts per layer), with those experts per layer."""
    used = {token: routing_margins(reference, [token] * 4)[1] for token in range(64)}
    for first in range(64):
        for second in range(first + 1, 64):
            layers = used[first]
            if all(not layers[i] & used[second][i] for i in layers):
                return first, second, {i: (layers[i], used[second][i]) for i in layers}
    raise AssertionError("no two tokens route to disjoint experts in every MoE layer")


def _run(model: Any, requests: list[list[int]], steps: int) -> list[torch.Tensor]:
    """The requests' prompts prefilled in one step, then `steps` decode steps together, each
    fed its prompt's token again (teacher forcing): per request `[1 + steps, vocab]`."""
    cache, windows, layer_of = new_cache(model)
    segments: list[PrefillSegment] = []
    ids: list[int] = []
    positions: list[int] = []
    offset = 0
    for request in requests:
        slot = cache.allocate()
        segments.append(PrefillSegment(slot, 0, offset, len(request)))
        ids += request
        positions += range(len(request))
        offset += len(request)
    rows = [segment.offset + segment.length - 1 for segment in segments]
    plan = BatchPlan(cache, windows, [], [], segments, layer_of)
    out = [
        forward_batch(
            model, plan, torch.tensor([ids]), torch.tensor([positions]), torch.tensor(rows)
        )
    ]
    slots = [segment.slot for segment in segments]
    for step in range(steps):
        where = [len(request) + step for request in requests]
        plan = BatchPlan(cache, windows, slots, where, [], layer_of)
        fed = torch.tensor([[request[0] for request in requests]])
        out.append(forward_batch(model, plan, fed, torch.tensor([where]), torch.arange(len(slots))))
    return [torch.stack([step[i] for step in out]) for i in range(len(requests))]


def test_requests_on_disjoint_experts_decode_the_same_batched_as_alone(
    moe_dirs: dict[str, Path],
) -> None:
    directory = moe_dirs["sparse-step"]
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    first, second, experts = _disjoint_tokens(reference)
    assert experts and all(not a & b for a, b in experts.values())
    model = _load(directory)
    requests = [[first] * 9, [second] * 6]
    alone = [_run(model, [request], 4)[0] for request in requests]
    batched = _run(model, requests, 4)
    # A third request routed over both sets beside them changes neither.
    mixed = _run(model, [*requests, _prompt(1)[:7]], 4)[:2]
    for solo, together, beside in zip(alone, batched, mixed, strict=True):
        assert float((solo - together).abs().max()) < FLOAT32_TOLERANCE
        assert float((solo - beside).abs().max()) < FLOAT32_TOLERANCE


def test_routing_equals_qwen3_moe_router() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    for normalize in (True, False):
        config = Qwen3MoeConfig(
            hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=normalize
        )
        router = Qwen3MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight)
        rows = torch.randn(40, 32)
        logits, weights, experts = router(rows)
        ours_weights, ours_experts = route(
            logits, Routing(experts=16, experts_per_token=4, normalize=normalize)
        )
        assert torch.equal(ours_experts, experts)
        assert torch.allclose(ours_weights, weights, rtol=0, atol=1e-7)


def test_group_limited_sigmoid_routing_equals_deepseek_v3_router() -> None:
    """The parts of `Routing` later families use (sigmoid scores, correction bias,
    group-limited choice, scaling) against transformers' DeepSeek-V3 router."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    config = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_(0.0, 0.3)
    rows = torch.randn(40, 32)
    logits, weights, experts = router(rows)
    routing = Routing(
        experts=16, experts_per_token=4, scoring="sigmoid", normalize=True, scaling=2.5,
        groups=4, groups_per_token=2,
    )  # fmt: skip
    ours_weights, ours_experts = route(logits, routing, router.e_score_correction_bias)
    # Both choose the same experts (transformers' in no particular order).
    theirs_order, ours_order = experts.sort(dim=-1), ours_experts.sort(dim=-1)
    assert torch.equal(ours_order.values, theirs_order.values)
    assert torch.allclose(
        ours_weights.gather(1, ours_order.indices),
        weights.gather(1, theirs_order.indices),
        rtol=0,
        atol=1e-6,
    )


def test_routing_refuses_impossible_configs() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="num_experts_per_tok=9"):
        Routing(experts=8, experts_per_token=9)
    # The refusal names the experts field as the family's checkpoints do (Mixtral's).
    with pytest.raises(UnsupportedArchitectureError, match=r"and num_local_experts=8$"):
        Routing(experts=8, experts_per_token=9, experts_field="num_local_experts")
    with pytest.raises(UnsupportedArchitectureError, match="groups"):
        Routing(experts=8, experts_per_token=2, groups=3)


def test_dispatch_runs_each_chosen_expert_once_on_all_its_rows() -> None:
    """Rows grouped by expert: an expert no row chose is never called, a chosen one once
    with all of its rows; an expert this rank does not hold (None) contributes nothing."""
    calls: dict[int, int] = {}

    def expert(index: int) -> Any:
        def run(rows: torch.Tensor) -> torch.Tensor:
            calls[index] = calls.get(index, 0) + rows.shape[0]
            return rows * (index + 1)

        return run

    rows = torch.randn(5, 3)
    experts = torch.tensor([[0, 2], [2, 0], [2, 3], [0, 3], [3, 2]])
    weights = torch.rand(5, 2)
    functions = [expert(i) for i in range(4)]
    out = dispatch(rows, experts, weights, functions)
    assert calls == {0: 3, 2: 4, 3: 3}  # expert 1 unread; each chosen expert called once
    expected = torch.zeros(5, 3)
    for row in range(5):
        for slot in range(2):
            chosen = int(experts[row, slot])
            expected[row] += weights[row, slot] * rows[row] * (chosen + 1)
    assert torch.allclose(out, expected, atol=1e-6)
    held = dispatch(rows, experts, weights, [functions[0], None, None, functions[3]])
    partial = dispatch(rows, experts, weights, [None, None, functions[2], None])
    assert torch.allclose(held + partial, expected, atol=1e-6)  # expert ranks' parts sum


def test_routed_experts_keep_a_share_and_load_only_its_tensors() -> None:
    experts = RoutedExperts(total=5, hidden=8, intermediate=4, act_fn=torch.nn.SiLU())
    assert sorted(experts.held()) == [0, 1, 2, 3, 4] and not experts.reduce
    experts.keep([1, 3])
    assert sorted(experts.held()) == [1, 3] and experts.reduce
    names = {name for name, _ in experts.named_parameters()}
    assert "1.gate_proj.weight" in names and not any(name.startswith("0.") for name in names)
    # Linears named as the family's checkpoints name them (Mixtral: w1 gate, w3 up, w2 down).
    mixtral = RoutedExperts(total=2, hidden=8, intermediate=4, act_fn=torch.nn.SiLU(),
                            names=("w1", "w3", "w2"))  # fmt: skip
    assert {name for name, _ in mixtral.named_parameters()} == {
        f"{expert}.{linear}.weight" for expert in (0, 1) for linear in ("w1", "w2", "w3")
    }
    expert = mixtral.held()[1].to_empty(device="cpu")
    for name in ("w1", "w2", "w3"):
        torch.nn.init.normal_(getattr(expert, name).weight)
    rows = torch.randn(3, 8)
    expected = expert.w2(torch.nn.functional.silu(expert.w1(rows)) * expert.w3(rows))
    assert torch.equal(expert(rows), expected)


def test_int4_experts_err_as_much_as_a_dense_int4_mlp(tmp_path: Path, real_model_dir: Path) -> None:
    """Every expert's linears are held in int4 groups like a dense layer's (their shapes fit:
    outputs a multiple of 64), the router stays float32, so the same rows take the same
    experts; the MoE block's relative error against float32 is that of int4 weights, of
    the size a dense MLP's is in the same model."""
    directory = save_tiny_model(
        tmp_path / "int4", "qwen3_moe", real_model_dir, n_layers=2, hidden_size=128,
        head_dim=32, intermediate_size=128,
    )  # fmt: skip
    shard = make_shard(directory, "pipeline", 0, 1)
    float_model, int4_model = (
        lean_step_of(load_model(directory, shard, CPU, dtype)) for dtype in ("float32", "int4")
    )
    assert isinstance(float_model, LeanModel) and isinstance(int4_model, LeanModel)
    sparse, dense = int4_model.layers  # mlp_only_layers [1]
    assert sparse.moe is not None and dense.moe is None
    experts = [expert for expert in sparse.moe.experts if expert is not None]
    leaves = [part for e in experts for p in (e.gate_up, e.down) for part in p.parts or [p]]  # type: ignore[attr-defined]
    assert len(experts) == 4 and all(isinstance(leaf.quantized, Int4Linear) for leaf in leaves)
    rows = torch.nn.functional.rms_norm(
        torch.randn(64, 128, generator=torch.Generator().manual_seed(0)), (128,)
    )
    reference_moe = float_model.layers[0].moe
    assert reference_moe is not None
    with torch.inference_mode():
        expected, got = reference_moe(rows), sparse.moe(rows)
        moe_error = float((got - expected).norm() / expected.norm())
        mlp_error = float(
            (_dense_mlp(dense, rows) - _dense_mlp(float_model.layers[1], rows)).norm()
        )
        mlp_error /= float(_dense_mlp(float_model.layers[1], rows).norm())
    print(f"int4 relative error: MoE block {moe_error:.3g}, dense MLP {mlp_error:.3g}")
    assert 0 < moe_error < 2 * mlp_error and mlp_error < 0.2


def _dense_mlp(layer: Any, rows: torch.Tensor) -> torch.Tensor:
    gate_up = layer.gate_up(rows.to(layer.gate_up.in_dtype)).float()
    middle = layer.intermediate
    activated = layer.activation(gate_up[:, :middle]) * gate_up[:, middle:]
    return layer.down(activated.to(layer.down.in_dtype)).float()
