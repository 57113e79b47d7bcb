"""A Qwen3-MoE GGUF (arch `qwen3moe`, experts stacked in `ffn_*_exps`) loads like a Hugging
Face checkpoint: a tiny random one written with `gguf` (Q4_K random blocks, Q8_0 from
Gaussian weights), converted (`gguf_repack.convert_gguf`, single file and split into parts)
and run through the engine's step, gives the logits of its safetensors twin — the same
blocks dequantized by `gguf` itself, written under the checkpoint names by this test —
within `TWIN_TOLERANCE`; an expert-parallel rank holds only its experts, each the single
rank's; a GGUF lacking an expert tensor is refused naming it.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import save_file

from exo.download.gguf_experts import GgufExpertsError
from exo.download.gguf_models import GgufModelError, card_for_gguf
from exo.download.gguf_repack import convert_gguf
from exo.download.gguf_tensors import read_gguf_model
from exo.download.pypi_gguf import ModelPreparationError, prepare_model
from exo.shared.models.moe import experts_of_rank
from exo.testing.random_moe_gguf import MoeGgufShape, write_random_moe_gguf
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.model.moe import RoutedExperts
from exo.worker.engines.torch.tests.test_distributed import make_shard
from exo.worker.engines.torch.tests.test_moe import engine_greedy

CPU = torch.device("cpu")
SHAPE = MoeGgufShape()  # 2 layers, hidden 256, top 2 of 4 experts of width 256
# Largest |GGUF - twin| float32 logit: the repacked int4 groups give `(q - 8) s + z` where
# `gguf` computes `d sc q - dmin m`, equal up to float32 rounding (~1e-7 of a weight).
TWIN_TOLERANCE = 1e-4
# Relative Frobenius error of the logits when the engine holds the Q4_K experts as int4
# groups (bfloat16 scales and zeros, bfloat16 activations) against the float32 twin: ~1%
# measured (2026-12-04); a wrongly sliced expert gives ~100%.
INT4_RELATIVE_TOLERANCE = 0.03
PROMPT = [int(token) for token in np.random.default_rng(0).integers(3, SHAPE.vocab_size, 64)]
# GGUF name inside a block -> checkpoint name inside a decoder layer (Qwen3-MoE's own).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
}  # fmt: skip
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def write_twin(gguf_path: Path, directory: Path, tokenizer_from: Path) -> Path:
    """The GGUF's safetensors twin: every tensor dequantized by `gguf`, per-expert names,
    a Qwen3-MoE config.json of `SHAPE` and the tokenizer files of `tokenizer_from`."""
    from transformers import Qwen3MoeConfig

    tensors: dict[str, torch.Tensor] = {}
    for tensor in read_gguf_model(gguf_path).tensors:
        values = dequantize(tensor.data, GGMLQuantizationType[tensor.type_name])
        values = np.array(values.reshape(tuple(reversed(tensor.shape))), np.float32, copy=True)
        block = re.match(r"^blk\.(\d+)\.(\w+)\.weight$", tensor.name)
        if block is None:
            tensors[_TOP[tensor.name.removesuffix(".weight")] + ".weight"] = torch.from_numpy(
                values
            )
        elif block.group(2) in _EXPERTS:
            for expert, weight in enumerate(values):
                name = f"model.layers.{block.group(1)}.mlp.experts.{expert}"
                tensors[f"{name}.{_EXPERTS[block.group(2)]}.weight"] = torch.from_numpy(weight)
        else:
            name = f"model.layers.{block.group(1)}.{_LAYER_NAMES[block.group(2)]}.weight"
            tensors[name] = torch.from_numpy(values)
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    settings: dict[str, Any] = dict(
        hidden_size=SHAPE.hidden_size, num_hidden_layers=SHAPE.n_layers,
        num_attention_heads=SHAPE.num_attention_heads, head_dim=SHAPE.head_dim,
        num_key_value_heads=SHAPE.num_key_value_heads, num_experts=SHAPE.experts,
        num_experts_per_tok=SHAPE.experts_per_token, norm_topk_prob=True,
        moe_intermediate_size=SHAPE.expert_intermediate_size,
        intermediate_size=SHAPE.intermediate_size, vocab_size=SHAPE.vocab_size,
        max_position_embeddings=SHAPE.context_length, rms_norm_eps=1e-6,
        rope_theta=SHAPE.rope_theta, tie_word_embeddings=False, mlp_only_layers=[],
        architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    config = Qwen3MoeConfig(**settings)
    config.save_pretrained(directory)
    for tokenizer_file in tokenizer_from.glob("tokenizer*.json"):
        shutil.copy(tokenizer_file, directory / tokenizer_file.name)
    return directory


def converted(gguf_path: Path, directory: Path) -> Path:
    directory.mkdir()
    convert_gguf(gguf_path, directory)
    return directory


def logits_of(model_dir: Path, weight_dtype: Any = "float32") -> torch.Tensor:
    shard = make_shard(model_dir, "pipeline", 0, 1)
    model: Any = load_model(model_dir, shard, CPU, weight_dtype)
    return engine_greedy(model, PROMPT)[0]


@pytest.mark.parametrize(
    ("tensor_type", "split"), [("Q4_K", False), ("Q4_K", True), ("Q8_0", False)]
)
def test_moe_gguf_loads_to_its_dequantized_twins_logits(
    tmp_path: Path, tensor_type: str, split: bool
) -> None:
    files = write_random_moe_gguf(
        tmp_path / "moe.gguf", SHAPE, tensor_type, split_max_tensors=9 if split else 0
    )
    assert len(files) == (3 if split else 1)
    model_dir = converted(files[0], tmp_path / "converted")
    twin = write_twin(files[0], tmp_path / "twin", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["moe_intermediate_size"] == SHAPE.expert_intermediate_size
    assert config["tie_word_embeddings"] is False  # output.weight is in a later part when split
    expected, ours = logits_of(twin), logits_of(model_dir)
    assert expected.shape == ours.shape == (64 + 16, SHAPE.vocab_size)
    assert expected.abs().max() > 1.0  # logits that could differ
    assert (ours - expected).abs().max() <= TWIN_TOLERANCE
    if tensor_type == "Q4_K" and not split:  # the experts' int4 groups run by the int4 kernels
        held = logits_of(model_dir, "int4")
        assert (held - expected).norm() / expected.norm() <= INT4_RELATIVE_TOLERANCE


def test_moe_gguf_card_and_expert_rank_reading_its_experts(tmp_path: Path) -> None:
    files = write_random_moe_gguf(tmp_path / "moe.gguf", SHAPE, "Q4_K", split_max_tensors=9)
    card = card_for_gguf(files[0], "random-moe")
    assert card.architecture == "Qwen3MoeForCausalLM"
    assert card.storage_size_bytes == sum(path.stat().st_size for path in files)
    assert card.moe is not None and (card.moe.experts, card.moe.experts_per_token) == (4, 2)
    assert card.moe.expert_intermediate_size == SHAPE.expert_intermediate_size
    assert not card.moe.mxfp4_experts  # Q4_K experts: the engine's int4 groups
    model_dir = converted(files[0], tmp_path / "converted")
    whole: Any = load_model(model_dir, make_shard(model_dir, "pipeline", 0, 1), CPU)
    rank: Any = load_model(model_dir, make_shard(model_dir, "expert", 1, 2), CPU)
    for layer, whole_layer in zip(rank.model.layers, whole.model.layers, strict=True):
        held, all_experts = layer.mlp.experts, whole_layer.mlp.experts
        assert isinstance(held, RoutedExperts) and isinstance(all_experts, RoutedExperts)
        assert sorted(held.held()) == list(experts_of_rank(SHAPE.experts, 1, 2))
        for expert, module in held.held().items():
            for name, weight in module.state_dict().items():
                assert torch.equal(weight, all_experts.held()[expert].state_dict()[name])


def test_moe_gguf_with_a_mis_shaped_expert_tensor_has_no_card(tmp_path: Path) -> None:
    """The metadata says 4 experts of width 256; the file's stacked tensors hold 3."""
    path = tmp_path / "moe.gguf"
    write_random_moe_gguf(path, replace(SHAPE, experts=3), "F32")
    # The key, its type (uint32, 4) and its value, little-endian: 3 becomes 4.
    key = b"qwen3moe.expert_count" + (4).to_bytes(4, "little")
    data = path.read_bytes()
    assert data.count(key + (3).to_bytes(4, "little")) == 1
    path.write_bytes(data.replace(key + (3).to_bytes(4, "little"), key + (4).to_bytes(4, "little")))
    with pytest.raises(GgufModelError, match=r"blk\.0\.ffn_gate_exps\.weight has shape"):
        card_for_gguf(path, "random-moe")


def test_moe_gguf_without_an_expert_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    files = write_random_moe_gguf(tmp_path / "moe.gguf", SHAPE, "F32", split_max_tensors=9)
    # The last part with blk.1's down experts: rename it so the layer lacks that tensor.
    last = files[-1].read_bytes().replace(b"blk.1.ffn_down_exps", b"blk.1.ffn_down_expx")
    files[-1].write_bytes(last)
    with pytest.raises(GgufExpertsError, match=r"blk\.1\.ffn_down_exps\.weight"):
        converted(files[0], tmp_path / "converted")
    # Refused when its card is built (`POST /models/add`), from the tensor index alone.
    with pytest.raises(GgufModelError, match=r"no blk\.1\.ffn_down_exps\.weight"):
        card_for_gguf(files[0], "random-moe")


def test_a_gguf_that_fails_to_convert_is_a_permanent_preparation_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The card was built while the file was whole; it lost a tensor since: preparing it
    fails naming the tensor, marked permanent (the node does not retry the same file)."""
    for name in ("EXO_MODELS_DIRS", "EXO_MODELS_READ_ONLY_DIRS"):
        monkeypatch.delenv(name, raising=False)
    path = write_random_moe_gguf(tmp_path / "moe.gguf", SHAPE, "F32")[0]
    card = card_for_gguf(path, "random-moe")
    path.write_bytes(path.read_bytes().replace(b"blk.1.ffn_down_exps", b"blk.1.ffn_down_expx"))
    with pytest.raises(ModelPreparationError, match=r"blk\.1\.ffn_down_exps\.weight") as raised:
        prepare_model(card, tmp_path / "models", offline=True)
    assert raised.value.permanent
