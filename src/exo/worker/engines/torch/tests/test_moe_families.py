"""The mixture-of-experts families beside Qwen3-MoE through the engine's real step against
transformers' own implementation (the checks of `test_moe.py`, generic over families):
tiny random-weight models of each family's real config with small sizes (top-k >= 2, a
shared expert where the family has one) give float32 logits within `FLOAT32_TOLERANCE` over
a 64-token prompt and 16 greedy steps, with no routing decision near a tie (the margin is
taken where the family decides: softmax logits, or sigmoid scores plus the correction bias
and the group choice); requests routed to disjoint experts decode the same batched as alone;
configs a family cannot route are refused naming the field.

The sharded checks of these families (pipeline, tensor, expert) are `test_distributed.py`'s,
marked slow.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from exo.shared.models.cards import card_from_local_directory
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import lean_step_of
from exo.worker.engines.torch.model.direct_forward import LeanModel
from exo.worker.engines.torch.model.families import ModelFamily, family_by_name
from exo.worker.engines.torch.model.families.spec import Routing, UnsupportedArchitectureError
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.model.moe import routed_experts_of
from exo.worker.engines.torch.tests.test_distributed import make_shard
from exo.worker.engines.torch.tests.test_moe import (
    FLOAT32_TOLERANCE,
    GREEDY_STEPS,
    PROMPT_LENGTH,
    _load,
    _prompt,
    _run,
    engine_greedy,
)

# (family, variant) → config fields over the family's tiny defaults.
CONFIGS: dict[tuple[str, str], dict[str, Any]] = {
    ("glm4_moe", "shared"): {},
    # Group-limited routing (best 2 of 4 groups of 2), two shared experts' width, no q/k
    # norms nor biases (as GLM-4.5-Air), not renormalized, every layer sparse.
    ("glm4_moe", "grouped"): {
        "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
        "n_shared_experts": 2, "use_qk_norm": False, "attention_bias": False,
        "norm_topk_prob": False, "first_k_dense_replace": 0, "routed_scaling_factor": 1.0,
    },
    ("mixtral", "top-2"): {"sliding_window": None},
    # Top 3 of 8 with a sliding window shorter than the prompt.
    ("mixtral", "top-3-window"): {
        "num_local_experts": 8, "num_experts_per_tok": 3, "sliding_window": 16,
    },
    ("minimax_m2", "top-2"): {},
    # Top 3 of 8, rotary over a quarter of each head.
    ("minimax_m2", "top-3"): {"num_local_experts": 8, "num_experts_per_tok": 3, "rotary_dim": 4},
    # Low-rank queries, top 2 of 8 in the best of 2 groups, a shared expert, layer 0 dense.
    ("deepseek_v3", "q-lora"): {},
    # One q_proj (q_lora_rank null, as DeepSeek-V2-Lite), the best 3 of 4 groups, top 3,
    # rotary not interleaved, YaRN scaling (Kimi-K2's rope_scaling: the softmax scale takes
    # its mscale), two shared experts' width.
    ("deepseek_v3", "q-proj-yarn"): {
        "q_lora_rank": None, "n_group": 4, "topk_group": 3, "num_experts_per_tok": 3,
        "rope_interleave": False, "n_shared_experts": 2,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16,
        },
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[Any, Path]:
    return {
        key: save_tiny_model(
            tmp_path_factory.mktemp(f"moe-{key[0]}-{key[1]}"),
            key[0],
            real_model_dir,
            n_layers=3,
            tie_word_embeddings=False,
            **overrides,
        )
        for key, overrides in CONFIGS.items()
    }


def _correction_bias(layer: Any, family: ModelFamily) -> torch.Tensor | None:
    assert family.moe is not None
    if family.moe.correction_bias is None:
        return None
    owner, _, name = family.moe.correction_bias.rpartition(".")
    bias = getattr(layer.get_submodule(owner) if owner else layer, name)
    return bias.detach().float()


def routing_margin(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None) -> float:
    """The smallest gap, over rows `[T, experts]` of router logits, between the last chosen
    and the first unchosen candidate where the family decides: softmax logits (the ranking
    of softmax scores), else sigmoid scores plus `bias`; with groups, also between the last
    kept and the first dropped group's score. (A sigmoid score moves by at most a quarter
    of its logit's error, so a score margin above the tolerance holds for the logits too.)"""
    k = routing.experts_per_token
    if routing.scoring == "softmax":
        choice = logits.float()
    else:
        choice = torch.sigmoid(logits.float()) + (0.0 if bias is None else bias)
    margin = float("inf")
    if routing.groups > 1:
        grouped = choice.view(choice.shape[0], routing.groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
        kept = routing.groups_per_token
        margin = float((group_scores[:, kept - 1] - group_scores[:, kept]).min())
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(kept, dim=-1).indices
        mask = torch.zeros(choice.shape[0], routing.groups, dtype=torch.bool)
        mask.scatter_(1, best, True)
        choice = choice.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=1), -1e9)
    ranked = choice.sort(dim=-1, descending=True).values
    return min(margin, float((ranked[:, k - 1] - ranked[:, k]).min()))


def family_routing(
    reference: Any, family: ModelFamily, ids: list[int]
) -> tuple[float, dict[int, set[int]]]:
    """Transformers' own routers over `ids`: the smallest routing margin in any MoE layer
    (`routing_margin`), and the experts chosen per MoE layer."""
    assert family.moe is not None
    routing = family.moe.routing(reference.config)
    recorded: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(reference.model.layers):
        if hasattr(layer.mlp, "experts"):
            gate = layer.mlp.get_submodule(family.moe.router.removeprefix("mlp."))

            def keep(_module: Any, _inputs: Any, output: Any, index: int = index) -> None:
                recorded[index] = output[0].detach()  # router logits [T, experts]

            hooks.append(gate.register_forward_hook(keep))
    try:
        with torch.no_grad():
            reference(input_ids=torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    from exo.worker.engines.torch.model.moe import route

    margin = float("inf")
    chosen: dict[int, set[int]] = {}
    for index, logits in recorded.items():
        bias = _correction_bias(reference.model.layers[index], family)
        margin = min(margin, routing_margin(logits, routing, bias))
        _, experts = route(logits.float(), routing, bias)
        chosen[index] = set(experts.flatten().tolist())
    return margin, chosen


@pytest.mark.parametrize("key", list(CONFIGS), ids=lambda key: "-".join(key))
def test_moe_family_equals_transformers(family_dirs: dict[Any, Path], key: Any) -> None:
    name, _ = key
    family = family_by_name(name)
    model = _load(family_dirs[key])
    lean = lean_step_of(model)
    assert isinstance(lean, LeanModel)  # the fast path, not transformers' fallback
    sparse = [i for i, layer in enumerate(model.model.layers) if routed_experts_of(layer, family)]
    card = card_from_local_directory(family_dirs[key])
    assert card.moe is not None
    assert list(card.moe.dense_layers) == [i for i in range(card.n_layers) if i not in sparse]
    assert [i for i, layer in enumerate(lean.layers) if layer.moe is not None] == sparse
    reference = AutoModelForCausalLM.from_pretrained(family_dirs[key], dtype=torch.float32).eval()
    prompt = _prompt()
    ours, tokens = engine_greedy(model, prompt)
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor([prompt + tokens])).logits[0]
    assert ours.shape == theirs.shape == (PROMPT_LENGTH + GREEDY_STEPS, reference.config.vocab_size)
    difference = float((ours - theirs).abs().max())
    margin, chosen = family_routing(reference, family, prompt + tokens)
    print(f"{key}: max |engine - transformers| logit {difference:.3g}, routing margin {margin:.3g}")
    assert difference < FLOAT32_TOLERANCE
    assert theirs[PROMPT_LENGTH - 1 : -1].argmax(-1).tolist() == tokens
    assert margin > FLOAT32_TOLERANCE
    assert family.moe is not None
    experts = family.moe.routing(reference.config).experts
    assert all(used == set(range(experts)) for used in chosen.values())  # every expert ran


# Each family's first variant.
FIRST_VARIANTS = list({key[0]: key for key in reversed(CONFIGS)}.values())


@pytest.mark.parametrize("key", FIRST_VARIANTS, ids=lambda key: "-".join(key))
def test_moe_family_disjoint_requests_batched_as_alone(
    family_dirs: dict[Any, Path], key: Any
) -> None:
    """Two requests whose tokens route to disjoint experts in every MoE layer (a repeated
    token: one hidden state per position), and a third over both, batched as alone."""
    family = family_by_name(key[0])
    reference = AutoModelForCausalLM.from_pretrained(family_dirs[key], dtype=torch.float32).eval()
    used = {token: family_routing(reference, family, [token] * 4)[1] for token in range(64)}
    pair = next(
        (first, second)
        for first in range(64)
        for second in range(first + 1, 64)
        if all(not used[first][i] & used[second][i] for i in used[first])
    )
    model = _load(family_dirs[key])
    requests = [[pair[0]] * 9, [pair[1]] * 6]
    alone = [_run(model, [request], 4)[0] for request in requests]
    batched = _run(model, requests, 4)
    mixed = _run(model, [*requests, _prompt(1)[:7]], 4)[:2]
    for solo, together, beside in zip(alone, batched, mixed, strict=True):
        assert float((solo - together).abs().max()) < FLOAT32_TOLERANCE
        assert float((solo - beside).abs().max()) < FLOAT32_TOLERANCE


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        # GLM-4.5's experts field is its own: n_routed_experts.
        ("num_experts_per_tok", 5, "num_experts_per_tok=5 must be between 1 and n_routed_experts="),
        ("scoring_func", "softmax", "scoring_func='softmax'"),
    ],
)
def test_loading_refuses_a_config_the_family_cannot_route(
    family_dirs: dict[Any, Path], tmp_path: Path, field: str, value: Any, named: str
) -> None:
    """More experts per token than experts, or another scoring function than the family's
    router computes: refused at load, naming the config field."""
    good = family_dirs[("glm4_moe", "shared")]
    directory = tmp_path / "bad"
    shutil.copytree(good, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, field: value}))
    # The engine's own check (the card of such a config is refused before: `moe.py`).
    shard = make_shard(good, "pipeline", 0, 1)
    with pytest.raises(UnsupportedArchitectureError, match=re.escape(named)):
        load_model(directory, shard, torch.device("cpu"), "float32")


def test_mixtral_loads_the_hub_checkpoint_names(family_dirs: dict[Any, Path]) -> None:
    """Mixtral checkpoints name the block `block_sparse_moe` and an expert's linears w1 / w3
    / w2 (as the Hub's and transformers' saved ones do); the engine's modules are `mlp`."""
    directory = family_dirs[("mixtral", "top-2")]
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in name for name in names)
    model = _load(directory)
    expert = model.model.layers[0].get_submodule("mlp.experts.3")
    assert {name for name, _ in expert.named_parameters()} == {
        "w1.weight",
        "w2.weight",
        "w3.weight",
    }
