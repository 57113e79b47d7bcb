"""A gpt-oss GGUF (arch `gpt-oss`, MXFP4 experts stacked in `ffn_*_exps` with their biases,
attention sinks, a biased router, YaRN, sliding / full layers) loads into the gpt_oss
family: a tiny random one written with `gguf` (`random_gptoss_gguf`; MXFP4 by gguf's own
quantizer, Q8_0 attention), converted (`gguf_repack.convert_gguf`) and run through the
engine's step, gives the logits of its twin — every tensor dequantized by `gguf` itself and
written as a Hugging Face gpt-oss checkpoint (stacked `gate_up_proj` with gate / up
interleaved) read by the existing gpt_oss path — within `TWIN_TOLERANCE`, its experts held
as MXFP4; its card has the MoE geometry and sizes the experts at MXFP4's 17 bytes per 32
weights; it is found in an Ollama store and prepared from there; the same weights laid out
as Ollama's first gpt-oss blobs (arch `gptoss`) convert to the same tensors; a GGUF lacking
an expert bias is refused naming it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import save_file

from exo.download.gguf_experts import GgufExpertsError
from exo.download.gguf_gptoss import MXFP4_BLOCK, repack_mxfp4
from exo.download.gguf_models import card_for_gguf, ollama_store_cards
from exo.download.gguf_repack import convert_gguf
from exo.download.gguf_tensors import read_gguf_model
from exo.shared.models.cards import card_from_local_directory
from exo.shared.models.memory import decoder_layer_bytes
from exo.shared.models.moe import experts_of_rank
from exo.testing.random_gptoss_gguf import (
    GptOssGgufShape,
    write_ollama_first_gptoss_gguf,
    write_random_gptoss_gguf,
)
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.model.moe import RoutedExperts
from exo.worker.engines.torch.quant.mxfp4 import FP4_VALUES, SCALE_BIAS, Mxfp4Linear
from exo.worker.engines.torch.quant.native_kernels import NATIVE_INT4_ENV, native_int4_kernel
from exo.worker.engines.torch.tests.test_distributed import make_shard
from exo.worker.engines.torch.tests.test_moe import engine_greedy

CPU = torch.device("cpu")
SHAPE = GptOssGgufShape()  # 2 layers (sliding, full), hidden 64, top 2 of 4 experts
# Largest |GGUF - twin| float32 logit: MXFP4 and Q8_0 values are exact in float32, so only
# the order of float32 operations differs (the fused MXFP4 kernel, which rounds activations
# to int16, is off for this comparison).
TWIN_TOLERANCE = 1e-4
FUSED_RELATIVE_TOLERANCE = 1e-4
PROMPT = [int(token) for token in np.random.default_rng(0).integers(3, SHAPE.vocab_size, 64)]
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
}  # fmt: skip
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _dequantized(gguf_path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF as float32 in row-major order (`gguf`'s dequantizer)."""
    values: dict[str, np.ndarray] = {}
    for tensor in read_gguf_model(gguf_path).tensors:
        array = dequantize(tensor.data, GGMLQuantizationType[tensor.type_name])
        values[tensor.name] = np.array(
            array.reshape(tuple(reversed(tensor.shape))), np.float32, copy=True
        )
    return values


def write_twin(gguf_path: Path, directory: Path, converted_dir: Path) -> Path:
    """The GGUF as a float Hugging Face gpt-oss checkpoint: `mlp.experts.gate_up_proj`
    `[experts, hidden, 2 * width]` (gate at even, up at odd columns) and `down_proj`
    `[experts, width, hidden]` with their `_bias`, the other tensors under their names; the
    converted directory's config without its quantization_config, and its tokenizer."""
    tensors: dict[str, torch.Tensor] = {}
    stacked: dict[tuple[str, ...], np.ndarray] = {}
    for name, values in _dequantized(gguf_path).items():
        block = re.match(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
        if block is None:
            tensors[_TOP[name.removesuffix(".weight")] + ".weight"] = torch.from_numpy(values)
        elif block.group(2).endswith("_exps"):
            stacked[block.groups()] = values
        elif block.group(2) == "attn_sinks":
            tensors[f"model.layers.{block.group(1)}.self_attn.sinks"] = torch.from_numpy(values)
        else:
            layer, kind, part = block.groups()
            tensors[f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{part}"] = torch.from_numpy(values)
    for layer in range(SHAPE.n_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate, up = (stacked[(str(layer), f"ffn_{k}_exps", "weight")] for k in ("gate", "up"))
        gate_up = np.empty((SHAPE.experts, SHAPE.hidden_size, 2 * SHAPE.intermediate_size))
        gate_up[..., 0::2], gate_up[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        gate_bias, up_bias = (
            stacked[(str(layer), f"ffn_{k}_exps", "bias")] for k in ("gate", "up")
        )
        gate_up_bias = np.empty((SHAPE.experts, 2 * SHAPE.intermediate_size))
        gate_up_bias[:, 0::2], gate_up_bias[:, 1::2] = gate_bias, up_bias
        down = stacked[(str(layer), "ffn_down_exps", "weight")].transpose(0, 2, 1)
        for name, array in (
            ("gate_up_proj", gate_up), ("gate_up_proj_bias", gate_up_bias),
            ("down_proj", down), ("down_proj_bias", stacked[(str(layer), "ffn_down_exps", "bias")]),
        ):  # fmt: skip
            tensors[prefix + name] = torch.from_numpy(np.ascontiguousarray(array, np.float32))
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((converted_dir / "config.json").read_text())
    del config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    for path in converted_dir.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "generation")):
            shutil.copy(path, directory / path.name)
    return directory


def logits_of(model_dir: Path) -> tuple[torch.Tensor, list[int]]:
    model: Any = load_model(model_dir, make_shard(model_dir, "pipeline", 0, 1), CPU)
    return engine_greedy(model, PROMPT)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gptoss_gguf(tmp_path_factory.mktemp("gptoss") / "gpt-oss.gguf", SHAPE)


@pytest.fixture(scope="module")
def converted(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gptoss-converted")
    convert_gguf(gguf_path, directory)
    return directory


def dequantize_exo_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """exo's MXFP4 (`repack_mxfp4`'s layout) as float32 `[rows, in]`, in numpy (to check
    the repacking against `gguf`'s own dequantizer)."""
    table = np.array(FP4_VALUES, dtype=np.float32)
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*scales.shape, MXFP4_BLOCK)
    scale = np.exp2(scales.astype(np.float32) - SCALE_BIAS)[..., None]
    values: np.ndarray = (table[codes] * scale).reshape(scales.shape[0], -1)
    return values


def test_mxfp4_repacking_moves_nibbles_to_gguf_dequantized_values(gguf_path: Path) -> None:
    """ggml's MXFP4 blocks (low nibbles inputs 0-15, high 16-31) repacked into exo's layout
    (inputs 2j / 2j + 1 in byte j) dequantize to `gguf`'s own values, bit for bit."""
    tensor = next(
        t for t in read_gguf_model(gguf_path).tensors if t.name == "blk.0.ffn_down_exps.weight"
    )
    expected = dequantize(tensor.data, GGMLQuantizationType.MXFP4).reshape(
        -1, SHAPE.intermediate_size
    )
    blocks, scales = repack_mxfp4(tensor.data, expected.shape[0])
    assert blocks.shape == (expected.shape[0], SHAPE.intermediate_size // 32, 16)
    assert np.array_equal(dequantize_exo_mxfp4(blocks, scales), expected)
    assert np.abs(expected).max() > 0


def test_gptoss_gguf_loads_to_its_dequantized_twins_logits(
    gguf_path: Path, converted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NATIVE_INT4_ENV, "0")  # widened MXFP4: exact
    config = json.loads((converted / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == SHAPE.sliding_window
    assert config["rope_parameters"] == {
        "rope_type": "yarn", "factor": SHAPE.rope_factor, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": SHAPE.original_context_length, "truncate": False,
        "rope_theta": SHAPE.rope_theta,
    }  # fmt: skip
    assert (config["head_dim"], config["num_local_experts"]) == (SHAPE.head_dim, SHAPE.experts)
    twin = write_twin(gguf_path, tmp_path / "twin", converted)
    model: Any = load_model(converted, make_shard(converted, "pipeline", 0, 1), CPU)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert isinstance(experts, RoutedExperts) and experts.expert_format == "mxfp4"
        for expert in experts.held().values():
            assert all(
                isinstance(linear, Mxfp4Linear)
                for linear in (expert.gate_proj, expert.up_proj, expert.down_proj)
            )
    ours, tokens = engine_greedy(model, PROMPT)
    expected, expected_tokens = logits_of(twin)
    assert expected.shape == ours.shape == (64 + 16, SHAPE.vocab_size)
    assert expected.abs().max() > 1.0  # logits that could differ
    assert (ours - expected).abs().max() <= TWIN_TOLERANCE
    # exo's fused MXFP4 kernel on the repacked blocks (activations rounded to int16 per
    # block of 32 on AVX2): ~2e-5 relative measured (2026-12-05), the same greedy tokens.
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    if native_int4_kernel() is not None:
        fused, fused_tokens = engine_greedy(model, PROMPT)
        assert float((fused - expected).norm() / expected.norm()) <= FUSED_RELATIVE_TOLERANCE
        assert fused_tokens == tokens == expected_tokens


def test_gptoss_gguf_tokenizer_and_stop_tokens(converted: Path) -> None:
    """The tokenizer splits as o200k (`tokenizer.ggml.pre` "gpt-4o": digits in threes) and
    keeps the chat template; generation stops at the file's eos id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("abc 12345")
    assert [piece for piece, _ in pieces] == ["abc", "Ġ", "123", "45"]
    assert "<|channel|>" in str(tokenizer.chat_template)
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2]


def test_gptoss_gguf_card_sizes_mxfp4_experts(
    gguf_path: Path, converted: Path, tmp_path: Path
) -> None:
    card = card_for_gguf(gguf_path, "tiny-gptoss")
    assert card.architecture == "GptOssForCausalLM" and card.attention_bias
    assert card.moe is not None and (card.moe.experts, card.moe.experts_per_token) == (4, 2)
    assert card.moe.expert_intermediate_size == SHAPE.intermediate_size
    assert card.tool_call_format == "harmony" and "thinking" in card.capabilities
    assert card.gguf_weight_types is not None
    stored = dict(card.gguf_weight_types.layer_weights)
    expert_weights = 3 * SHAPE.experts * SHAPE.hidden_size * SHAPE.intermediate_size
    assert stored["MXFP4"] == SHAPE.n_layers * expert_weights
    # A MoE layer's bytes: its expert weights at 17 / 32 bytes, not as bfloat16 (2 bytes)
    # nor as int4 groups (20 / 32), the Q8_0 attention beside them at its own size.
    assert card.moe.mxfp4_experts
    layer = decoder_layer_bytes(card, "int4", sparse=True)
    without = decoder_layer_bytes(card, "int4", sparse=True, experts=0)
    assert layer - without == pytest.approx(expert_weights * 17 / 32, abs=1)
    # The converted directory's card (its config's quantization_config) says the same.
    assert card_from_local_directory(converted).moe == card.moe


def test_gptoss_expert_rank_holds_only_its_mxfp4_experts(converted: Path) -> None:
    whole: Any = load_model(converted, make_shard(converted, "pipeline", 0, 1), CPU)
    rank: Any = load_model(converted, make_shard(converted, "expert", 1, 2), CPU)
    for layer, whole_layer in zip(rank.model.layers, whole.model.layers, strict=True):
        held, all_experts = layer.mlp.experts.held(), whole_layer.mlp.experts.held()
        assert sorted(held) == list(experts_of_rank(SHAPE.experts, 1, 2))
        for expert, module in held.items():
            for name, weight in module.state_dict().items():
                assert torch.equal(weight, all_experts[expert].state_dict()[name])


def test_gptoss_gguf_in_an_ollama_store(gguf_path: Path, converted: Path, tmp_path: Path) -> None:
    """A store holding the tiny blob under `gpt-oss:tiny` lists its card by that name, and
    preparing it offline converts the blob (checked against its sha256) to the same
    tensors as a direct conversion."""
    import hashlib

    from safetensors.torch import load_file

    from exo.download.pypi_gguf import prepare_model

    store = tmp_path / "models"
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    (store / "blobs").mkdir(parents=True)
    shutil.copy(gguf_path, store / "blobs" / f"sha256-{digest}")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "gpt-oss" / "tiny"
    manifest.parent.mkdir(parents=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}
    manifest.write_text(json.dumps({"layers": [layer]}))
    cards, skipped = ollama_store_cards(store, {})
    assert skipped == []
    assert [(card.model_id, card.architecture) for card in cards] == [
        ("gpt-oss:tiny", "GptOssForCausalLM")
    ]
    assert cards[0].moe is not None
    directory = prepare_model(cards[0], tmp_path / "prepared", offline=True)
    prepared = load_file(str(directory / "model.safetensors"))
    direct = load_file(str(converted / "model.safetensors"))
    assert prepared.keys() == direct.keys()
    assert all(torch.equal(prepared[name], direct[name]) for name in direct)


def test_gptoss_gguf_without_an_expert_bias_is_refused_naming_it(
    gguf_path: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(
        gguf_path.read_bytes().replace(b"blk.1.ffn_up_exps.bias", b"blk.1.ffn_up_exps.bixs")
    )
    (tmp_path / "out").mkdir()
    with pytest.raises(GgufExpertsError, match=r"blk\.1\.ffn_up_exps\.bias"):
        convert_gguf(broken, tmp_path / "out")


def test_ollama_first_gptoss_blob_converts_to_the_same_tensors(
    gguf_path: Path, converted: Path, tmp_path: Path
) -> None:
    """The same weights laid out as Ollama's first gpt-oss blobs (arch `gptoss`, fused
    `attn_qkv`, interleaved `ffn_gate_up_exps`, MXFP4 as type 4 in Hugging Face's nibble
    order, no YaRN type or pre-tokenizer keys) give the same config, every stored tensor
    equal, and the same tokenizer split."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    blob = write_ollama_first_gptoss_gguf(tmp_path / "old.gguf", SHAPE)
    assert {t.type_name for t in read_gguf_model(blob).tensors} >= {"OLLAMA_MXFP4"}
    card = card_for_gguf(blob, "gpt-oss:old")
    assert card.architecture == "GptOssForCausalLM" and card.attention_bias
    assert card.moe is not None and card.moe.expert_intermediate_size == SHAPE.intermediate_size
    assert card.gguf_weight_types is not None
    new = card_for_gguf(gguf_path, "new").gguf_weight_types
    assert new is not None
    old_types = dict(card.gguf_weight_types.layer_weights)
    assert old_types.pop("OLLAMA_MXFP4") == dict(new.layer_weights).pop("MXFP4")
    assert decoder_layer_bytes(card, "int4", sparse=True) == decoder_layer_bytes(
        card_for_gguf(gguf_path, "new"), "int4", sparse=True
    )
    directory = tmp_path / "old"
    directory.mkdir()
    convert_gguf(blob, directory)
    config, expected_config = (
        json.loads((d / "config.json").read_text()) for d in (directory, converted)
    )
    assert config == expected_config
    ours, expected = (load_file(str(d / "model.safetensors")) for d in (directory, converted))
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[name], expected[name]) for name in expected)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("abc 12345")
    assert [piece for piece, _ in pieces] == ["abc", "Ġ", "123", "45"]
