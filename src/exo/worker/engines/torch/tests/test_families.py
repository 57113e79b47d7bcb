"""Every family file against its tiny random-weight model (built with the real transformers
class): the spec names real modules, its cache layout is transformers' own, the loader reads
every checkpoint layout it declares, and the memory estimate is what loading holds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from exo.shared.models.architectures import ENGINE_ARCHITECTURES
from exo.shared.models.cards import card_from_local_directory
from exo.shared.models.memory import resident_weight_bytes
from exo.shared.models.weight_share import WeightShare
from exo.shared.parallelism import parallelism
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.testing.tiny_models import ARCHITECTURES, WRAPPED_ARCHITECTURES, save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    forward_batch,
    lean_step_of,
)
from exo.worker.engines.torch.model.families import (
    FAMILIES,
    UnsupportedArchitectureError,
    family_by_name,
    family_for_architecture,
    supported_architectures,
)
from exo.worker.engines.torch.model.fusion import FusedRMSNorm
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.model.sharding import loaded_parameter_bytes
from exo.worker.engines.torch.parallel.tensor import check_tensor_parallel
from exo.worker.engines.torch.quant.quantize import WeightDtype
from exo.worker.engines.torch.tests.lean_steps import new_cache

CPU = torch.device("cpu")
PROMPT_IDS = list(range(100, 112))


def whole(card: ModelCard) -> ShardMetadata:
    return ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )


def greedy_tokens(model: Any, count: int = 8) -> list[int]:
    """Greedy tokens through the engine's real path: one request's prompt prefilled in one
    step of `forward_batch` (the loaded model's direct forward), then one decode step per
    token, over a slot KV cache."""
    cache, windows, layer_of = new_cache(model)
    slot = cache.allocate()
    prompt = PrefillSegment(slot, 0, 0, len(PROMPT_IDS))
    plan = BatchPlan(cache, windows, [], [], [prompt], layer_of)
    rows = torch.tensor([len(PROMPT_IDS) - 1])
    logits = forward_batch(
        model, plan, torch.tensor([PROMPT_IDS]), torch.tensor([list(range(len(PROMPT_IDS)))]), rows
    )
    tokens: list[int] = []
    for position in range(len(PROMPT_IDS), len(PROMPT_IDS) + count):
        tokens.append(int(logits[-1].argmax()))
        plan = BatchPlan(cache, windows, [slot], [position], [], layer_of)
        logits = forward_batch(
            model, plan, torch.tensor([[tokens[-1]]]), torch.tensor([[position]]), torch.tensor([0])
        )
    return tokens


def reference_greedy_tokens(model: nn.Module, count: int = 8) -> list[int]:
    """Greedy tokens of transformers' own model, the whole sequence run at every step (no
    cache: nothing of exo's on this path)."""
    ids = list(PROMPT_IDS)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT_IDS) :]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    """One 4-layer model per family (sliding window 4, shorter than the prompt)."""
    directories: dict[str, Path] = {}
    for name in ARCHITECTURES:
        directory = tmp_path_factory.mktemp(f"family-{name}")
        directories[name] = save_tiny_model(
            directory, name, real_model_dir, n_layers=4, sliding_window=4
        )
    return directories


def test_registry_names_are_unique_and_cover_every_tiny_model() -> None:
    names = [family.name for family in FAMILIES]
    assert len(set(names)) == len(names) and tuple(names) == ARCHITECTURES
    architectures = [a for f in FAMILIES for a in (*f.architectures, *f.wrapped_architectures)]
    assert len(set(architectures)) == len(architectures)
    assert family_for_architecture("Gemma3ForConditionalGeneration").name == "gemma3"
    assert family_for_architecture("Mistral3ForConditionalGeneration").name == "mistral"


def test_shared_architecture_table_matches_the_family_files() -> None:
    # The API validates custom models against the shared table without importing the engine.
    assert supported_architectures() == ENGINE_ARCHITECTURES


def test_an_architecture_without_a_family_file_is_named_in_the_error(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"'GPT2LMHeadModel'.*no model family"):
        family_for_architecture("GPT2LMHeadModel")
    # Through the loader: a checkpoint whose config declares an unknown architecture.
    directory = save_tiny_model(tmp_path / "renamed", "llama", None, n_layers=1, vocab_size=256)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    card = card_from_local_directory(tiny_dirs["llama"])
    with pytest.raises(UnsupportedArchitectureError, match="'FalconForCausalLM'"):
        load_model(directory, whole(card.model_copy(update={"n_layers": 1})), CPU)


def _has_module(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_spec_names_real_modules_and_transformers_cache_layout(
    name: str, tiny_dirs: dict[str, Path]
) -> None:
    family = family_by_name(name)
    reference = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32)
    assert type(reference).__name__ in family.architectures
    config = reference.config.get_text_config()
    sparse_layers = 0
    moe = family.moe
    for layer in reference.model.layers:
        paths = [*family.column_parallel, *family.row_parallel]
        shared = None if moe is None else moe.shared_expert
        if moe is not None and _has_module(layer, moe.experts):
            if shared is not None:  # beside the routed experts (GLM-4.5)
                assert _has_module(layer, shared)
            # A MoE layer: the router scores every expert, the experts are the stacked
            # weights `install_routed_experts` replaces; the dense MLP's linears are absent.
            sparse_layers += 1
            routing = moe.routing(config)
            router = layer.get_submodule(moe.router)
            assert tuple(router.weight.shape) == (routing.experts, config.hidden_size)
            assert layer.get_submodule(moe.experts).gate_up_proj.shape[0] == routing.experts
            paths = [
                path
                for path in paths
                if not path.startswith("mlp.") or (shared and path.startswith(shared + "."))
            ]
        elif shared is not None:  # a dense layer: no shared expert
            paths = [path for path in paths if not path.startswith(shared + ".")]
        for path in paths:
            owner, _, leaf = path.rpartition(".")
            block = layer.get_submodule(owner) if owner else layer
            if hasattr(block, leaf) and getattr(block, leaf) is None:
                continue  # one of two alternatives (DeepSeek-V3: q_proj or q_a/q_b_proj)
            assert type(layer.get_submodule(path)) is nn.Linear, path
        for path, parts in family.fused_parts.items():
            assert sum(parts(config)) == layer.get_submodule(path).out_features, path
    # A MoE family's tiny model has sparse layers (mixed with dense ones where the family
    # has those: `mlp_only_layers`, `first_k_dense_replace`; gpt-oss's are all sparse); a
    # dense family's none.
    assert (sparse_layers > 0) == (moe is not None)
    norms = {type(module) for module in reference.modules() if "RMSNorm" in type(module).__name__}
    assert set(family.rms_norms) <= norms
    # The cache windows the engine reads from the spec are transformers' own cache layout.
    theirs = DynamicCache(config=reference.config).layers
    windows = family.attention_windows(config)
    assert len(windows) == len(theirs) == config.num_hidden_layers
    for window, expected in zip(windows, theirs, strict=True):
        if isinstance(expected, DynamicSlidingWindowLayer):
            assert window == expected.sliding_window
        else:
            assert window is None


def test_a_family_can_refuse_tensor_parallelism_with_its_reason(
    tiny_dirs: dict[str, Path],
) -> None:
    refusing = dataclasses.replace(family_by_name("llama"), tensor_parallel_note="the test says so")
    config = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).config
    check_tensor_parallel(family_by_name("llama"), "LlamaForCausalLM", config, 2)
    with pytest.raises(UnsupportedArchitectureError, match=r"LlamaForCausalLM.*the test says so"):
        check_tensor_parallel(refusing, "LlamaForCausalLM", config, 2)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by .* 3"):
        check_tensor_parallel(family_by_name("llama"), "LlamaForCausalLM", config, 3)
    phi3_config = AutoModelForCausalLM.from_pretrained(tiny_dirs["phi3"]).config
    check_tensor_parallel(family_by_name("phi3"), "Phi3ForCausalLM", phi3_config, 2)


def test_gemma3_layout_has_sliding_layers() -> None:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        num_hidden_layers=4, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    assert family_by_name("gemma3").attention_windows(config) == (4, None, 4, None)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_loader_equals_transformers_and_fuses_the_spec_norms(
    name: str, tiny_dirs: dict[str, Path]
) -> None:
    directory = tiny_dirs[name]
    card = card_from_local_directory(directory)
    ours = load_model(directory, whole(card), CPU)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert greedy_tokens(ours) == reference_greedy_tokens(reference)
    fused = sum(isinstance(module, FusedRMSNorm) for module in ours.modules())
    # Two per layer and the final norm, plus the q/k norms where the family has them (or
    # MLA's q_a_layernorm and kv_a_layernorm).
    layout = family_by_name(name).layout
    qk_norms = layout is not None and (layout.qk_norms is not None or layout.latent_attention)
    assert fused == (2 * card.n_layers + 1 if family_by_name(name).rms_norms else 0) or (
        qk_norms and fused == 4 * card.n_layers + 1
    )


@pytest.mark.parametrize("name", WRAPPED_ARCHITECTURES)
def test_conditional_generation_checkpoint_loads_its_text_model(
    name: str, tiny_dirs: dict[str, Path], tmp_path: Path, real_model_dir: Path
) -> None:
    """Gemma 3 4B+ and Mistral-Small 3.1 keep the text model under `language_model.` next
    to a vision tower: the text engine loads the same model as from a text checkpoint."""
    wrapped = save_tiny_model(
        tmp_path / "wrapped", name, real_model_dir, n_layers=4, sliding_window=4, wrapped=True
    )
    config = json.loads((wrapped / "config.json").read_text())
    assert config["architectures"][0].endswith("ForConditionalGeneration")
    card = card_from_local_directory(wrapped)
    assert card.n_layers == 4
    expected = greedy_tokens(load_model(tiny_dirs[name], whole(card), CPU))
    assert greedy_tokens(load_model(wrapped, whole(card), CPU)) == expected
    # Pipeline ranks of the wrapped checkpoint cut it the same way.
    first = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=2,
        start_layer=0,
        end_layer=2,
    )
    assert len(load_model(wrapped, first, CPU).model.layers) == 2


def non_persistent_buffer_bytes(model: nn.Module) -> int:
    """Bytes of buffers computed at construction (rotary frequencies), not weights."""
    total = 0
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None:
                total += buffer.numel() * buffer.element_size()
    return total


@pytest.mark.parametrize(
    ("name", "weight_dtype"),
    [
        ("llama", "int4"), ("qwen2", "int8"), ("phi3", "int4"), ("qwen3_moe", "int4"),
        ("deepseek_v3", "int4"),
    ],
)  # fmt: skip
def test_memory_estimate_is_what_loading_holds(
    name: str, weight_dtype: WeightDtype, tmp_path: Path, real_model_dir: Path
) -> None:
    """The card-based estimate placement uses equals the bytes of weights the loaded model
    holds, for a whole model, a pipeline rank and a tensor rank. (Every part of Phi-3's
    fused projections fits int4 here, as in real models; the estimate sizes them by part.
    Qwen3-MoE's layer 0 is sparse, layer 1 dense: the pipeline rank holds the dense one; an
    expert rank holds its experts only. DeepSeek-V3's lean forward also holds kv_b_proj's
    rows as float32 for its absorbed attention: counted.)"""
    directory = save_tiny_model(
        tmp_path / name, name, real_model_dir, n_layers=2, vocab_size=512, hidden_size=256,
        intermediate_size=256, tie_word_embeddings=False,
    )  # fmt: skip
    card = card_from_local_directory(directory)
    cases: list[tuple[ShardMetadata, WeightShare]] = [
        (whole(card), WeightShare(layers=2)),
        (
            ShardMetadata(
                sharding="pipeline",
                model_card=card,
                device_rank=1,
                world_size=2,
                start_layer=1,
                end_layer=2,
            ),
            WeightShare(layers=1, holds_embedding=False, first_layer=1),
        ),
        (
            ShardMetadata(
                sharding="tensor",
                model_card=card,
                device_rank=0,
                world_size=2,
                start_layer=0,
                end_layer=card.n_layers,
            ),
            WeightShare(layers=2, tensor_parallel_ranks=2),
        ),
    ]
    if family_by_name(name).moe is not None:  # an expert rank: 2 of the 4 experts, 1 of 3
        expert = ShardMetadata(
            sharding="expert", model_card=card, device_rank=2, world_size=3, start_layer=0,
            end_layer=card.n_layers,
        )  # fmt: skip
        cases.append((expert, parallelism("expert").shard_weight_share(expert)))
    for shard, share in cases:
        model = load_model(directory, shard, CPU, weight_dtype)
        held = loaded_parameter_bytes(model) - non_persistent_buffer_bytes(model)
        lean = lean_step_of(model)
        for layer in getattr(lean, "layers", ()):
            latent = getattr(layer, "latent", None)
            if latent is not None:  # MLA's absorbed copies of kv_b_proj
                held += sum(t.numel() * t.element_size() for t in (latent.key_up, latent.value_up))
        assert held == resident_weight_bytes(card, weight_dtype, share), shard
