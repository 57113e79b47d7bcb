"""What the deepseek_v3 family adds beyond `test_moe_families.py`'s checks (engine equals
transformers, batched equals alone): the KV cache the engine builds holds the compressed
form of multi-head latent attention (the normed latent and the rotated rope key, nothing
else), placement's KV bytes count that; Kimi-K2's `kimi_k2` model type loads as this family
with its multi-token-prediction tensors left on disk; an MLA config without `kv_lora_rank`
is refused naming the field.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from exo.shared.models.cards import card_from_local_directory
from exo.shared.models.kv_cache_memory import KV_CACHE_VALUE_BYTES, kv_cache_bytes_per_token
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    forward_batch,
)
from exo.worker.engines.torch.engine_factory import load_engine
from exo.worker.engines.torch.model.families.spec import UnsupportedArchitectureError
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.tests.lean_steps import new_cache
from exo.worker.engines.torch.tests.test_distributed import make_shard
from exo.worker.engines.torch.tests.test_moe import _load, _prompt

CPU = torch.device("cpu")
LAYERS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    return save_tiny_model(
        tmp_path_factory.mktemp("deepseek-v3"), "deepseek_v3", real_model_dir, n_layers=LAYERS,
        tie_word_embeddings=False,
    )  # fmt: skip


def _config(directory: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return config


def _edited_copy(source: Path, target: Path, **fields: Any) -> Path:
    shutil.copytree(source, target)
    (target / "config.json").write_text(json.dumps({**_config(source), **fields}))
    return target


def _prefill_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    """`[len(prompt), vocab]` logits of one prefill step through the engine's step."""
    cache, windows, layer_of = new_cache(model)
    slot = cache.allocate()
    plan = BatchPlan(cache, windows, [], [], [PrefillSegment(slot, 0, 0, len(prompt))], layer_of)
    rows = torch.arange(len(prompt))
    return forward_batch(model, plan, torch.tensor([prompt]), rows[None], rows)


@pytest.mark.usefixtures("float32_kv")  # the latent compared with transformers' float32
def test_the_kv_cache_holds_the_latent_and_the_rope_key(model_dir: Path) -> None:
    """The engine's own slot cache: one head of kv_lora_rank + qk_rope_head_dim per layer
    (values a view of the keys' latent, no memory of their own), and after a prefill its
    latent part is what transformers' layer-0 modules make of the prompt's embeddings."""
    config = _config(model_dir)
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    engine = load_engine(model_dir, make_shard(model_dir, "pipeline", 0, 1))
    cache = engine.scheduler._cache
    assert len(cache.keys) == LAYERS and cache.latent_values == rank
    for keys, values in zip(cache.keys, cache.values, strict=True):
        slots, heads, capacity, width = keys.shape
        assert (heads, width) == (1, rank + rope)
        assert values.shape == (slots, 1, capacity, rank)
        assert values.data_ptr() == keys.data_ptr()  # a view: no value buffer
    per_token = sum(keys[0, :, 0].numel() * keys.element_size() for keys in cache.keys)
    assert per_token == LAYERS * (rank + rope) * 4  # float32 here (`float32_kv`)
    card = card_from_local_directory(model_dir)
    assert kv_cache_bytes_per_token(card) == LAYERS * (rank + rope) * KV_CACHE_VALUE_BYTES
    # Fill a slot and read the latent back.
    model = engine.model
    prompt = _prompt()[:20]
    slot = cache.allocate()
    layer_of = {id(layer.self_attn): index for index, layer in enumerate(model.model.layers)}
    plan = BatchPlan(
        cache, [None] * LAYERS, [], [], [PrefillSegment(slot, 0, 0, len(prompt))], layer_of
    )
    forward_batch(
        model, plan, torch.tensor([prompt]), torch.arange(len(prompt))[None],
        torch.tensor([len(prompt) - 1]),
    )  # fmt: skip
    layer = model.model.layers[0]
    with torch.no_grad():
        hidden = layer.input_layernorm(model.model.embed_tokens(torch.tensor(prompt)))
        compressed = layer.self_attn.kv_a_proj_with_mqa(hidden)
        latent = layer.self_attn.kv_a_layernorm(compressed[:, :rank])
    cached = cache.keys[0][slot, 0, : len(prompt)]
    assert float((cached[:, :rank] - latent).abs().max()) < 1e-5
    # The rope part is the rotated rope key: same norm per token as before rotation
    # (rotary is a rotation in pairs), and not the raw one past position 0.
    raw_rope = compressed[:, rank:]
    assert torch.allclose(cached[:, rank:].norm(dim=-1), raw_rope.norm(dim=-1), atol=1e-5)
    assert not torch.allclose(cached[1:, rank:], raw_rope[1:], atol=1e-3)
    assert float(cache.keys[0][slot, 0, len(prompt) :].abs().max()) == 0.0
    # The prefix cache's copy holds the keys only; written back (after the slot moved and
    # the buffers grew) the latents and their value views are the same.
    length = len(prompt)
    copy = cache.read(slot, length)
    assert copy.shape == (LAYERS, 1, 1, length, rank + rope)
    other = cache.allocate()
    cache.free(slot)  # `other` moves into `slot`
    cache.reserve(2 * cache.capacity)
    cache.write(slot, copy, length)
    for layer in range(LAYERS):
        assert torch.equal(cache.keys[layer][slot, :, :length], copy[layer, 0])
        assert torch.equal(cache.values[layer][slot, :, :length], copy[layer, 0, ..., :rank])
        assert cache.values[layer].data_ptr() == cache.keys[layer].data_ptr()
    assert other == 1


def test_kimi_k2_model_type_loads_as_deepseek_v3_without_its_mtp_layer(
    model_dir: Path, tmp_path: Path
) -> None:
    """Kimi-K2's config names model type `kimi_k2` with custom code (`auto_map`): loaded as
    deepseek_v3 without running it, to the same tokens. A multi-token-prediction layer
    stored as `model.layers.<num_hidden_layers>` (DeepSeek-V3's) is left on disk."""
    kimi = _edited_copy(
        model_dir, tmp_path / "kimi", model_type="kimi_k2",
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        num_nextn_predict_layers=1,
    )  # fmt: skip
    hidden = _config(model_dir)["hidden_size"]
    save_file(
        {
            f"model.layers.{LAYERS}.eh_proj.weight": torch.randn(hidden, 2 * hidden),
            f"model.layers.{LAYERS}.input_layernorm.weight": torch.ones(hidden),
        },
        str(kimi / "model-mtp.safetensors"),
    )
    prompt = _prompt()[:16]
    expected = _prefill_logits(_load(model_dir), prompt)
    assert torch.equal(_prefill_logits(_load(kimi), prompt), expected)
    assert card_from_local_directory(kimi).latent_attention is not None


@pytest.mark.parametrize("value", [None, 0])
def test_latent_attention_without_kv_lora_rank_is_refused(
    model_dir: Path, tmp_path: Path, value: Any
) -> None:
    """At load (the engine) and when a card is built (`POST /models/add`'s 400)."""
    bad = _edited_copy(model_dir, tmp_path / "bad", kv_lora_rank=value)
    named = re.escape(f"kv_lora_rank={value!r}")
    with pytest.raises(UnsupportedArchitectureError, match=named):
        load_model(bad, make_shard(model_dir, "pipeline", 0, 1), CPU, "float32")
    with pytest.raises(ValueError, match=named):
        card_from_local_directory(bad)
