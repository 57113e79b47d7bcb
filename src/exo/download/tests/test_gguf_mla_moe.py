"""DeepSeek-V3-style MoE GGUFs load like Hugging Face checkpoints: a tiny random `deepseek2`
(MLA, its up-projection split into `attn_k_b` / `attn_v_b` as llama.cpp writes it today, or
one `attn_kv_b` as before; YaRN; group-limited sigmoid routing with a correction bias; a
shared expert; a dense first layer) and a tiny random `glm4moe` (biased attention, q/k
norms, partial rotary, an MTP layer after the decoder layers) written with `gguf`
(`random_mla_moe_gguf`: Q4_K random blocks, Q8_0 / F32 from Gaussian weights), prepared
from their `.gguf` path (`card_for_gguf`, then `pypi_gguf.prepare_model`, as a `.gguf`
path or an Ollama blob is) and run through the engine's step, give the logits of their
safetensors twins — every tensor dequantized by `gguf` itself and written under the
checkpoint names with a config written here from the shape — within `TWIN_TOLERANCE`; the
card agrees with the converted config; a missing or mis-shaped sparse-layer tensor is
refused naming it.
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

from exo.download.gguf_configs import GgufConfigError
from exo.download.gguf_experts import GgufExpertsError
from exo.download.gguf_mla import GgufMlaError
from exo.download.gguf_models import GgufModelError, card_for_gguf
from exo.download.gguf_repack import convert_gguf
from exo.download.gguf_tensors import read_gguf_model
from exo.download.pypi_gguf import prepare_model
from exo.shared.models.profile import card_mismatches
from exo.testing.random_mla_moe_gguf import (
    GLM4MOE_SHAPE,
    MlaMoeGgufShape,
    write_random_mla_moe_gguf,
)
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.tests.test_distributed import make_shard
from exo.worker.engines.torch.tests.test_moe import engine_greedy

CPU = torch.device("cpu")
DEEPSEEK2_SHAPE = MlaMoeGgufShape()  # 2 layers (1 dense), hidden 256, top 2 of 8 in 2 groups
# Largest |GGUF - twin| float32 logit: the repacked int4 groups and the joined float32
# kv_b_proj hold the values `gguf` dequantizes, up to float32 rounding of one product and
# one sum per Q4_K weight (~1e-7 relative).
TWIN_TOLERANCE = 1e-4
PROMPT = [int(token) for token in np.random.default_rng(0).integers(3, 320, 64)]
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF name inside a block → checkpoint name inside a decoder layer (transformers' own).
_COMMON = {
    "attn_norm": "input_layernorm", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}  # fmt: skip
_DEEPSEEK = {
    **_COMMON, "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_q": "self_attn.q_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_GLM = {
    **_COMMON, "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
}  # fmt: skip
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def _twin_config(shape: MlaMoeGgufShape) -> Any:
    """The Hugging Face config of `shape`, written from the shape (not the GGUF)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.num_attention_heads, rms_norm_eps=1e-6,
        max_position_embeddings=shape.context_length, tie_word_embeddings=False,
        n_routed_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
        n_shared_experts=shape.shared_experts,
        moe_intermediate_size=shape.expert_intermediate_size,
        first_k_dense_replace=shape.dense_layers, norm_topk_prob=True,
        routed_scaling_factor=shape.routed_scaling_factor, n_group=shape.expert_groups,
        topk_group=shape.expert_groups_per_token, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if shape.architecture == "glm4moe":
        common["head_dim"] = shape.head_dim  # not in its signature; read by its attention
        return Glm4MoeConfig(
            **common, num_key_value_heads=shape.num_key_value_heads,
            attention_bias=True, use_qk_norm=True, architectures=["Glm4MoeForCausalLM"],
            rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta,
                             "partial_rotary_factor": shape.rope_dim / shape.head_dim},
        )  # fmt: skip
    yarn = {
        "rope_type": "yarn", "rope_theta": shape.rope_theta, "factor": shape.yarn_factor,
        "original_max_position_embeddings": shape.yarn_original_context,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": shape.mscale_all_dim,
        "mscale_all_dim": shape.mscale_all_dim,
    }  # fmt: skip
    return DeepseekV3Config(
        **common, num_key_value_heads=shape.num_attention_heads,
        q_lora_rank=shape.q_lora_rank or None, kv_lora_rank=shape.kv_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim, qk_nope_head_dim=shape.qk_nope_head_dim,
        v_head_dim=shape.v_head_dim, architectures=["DeepseekV3ForCausalLM"],
        rope_parameters=yarn if shape.yarn_factor else {
            "rope_type": "default", "rope_theta": shape.rope_theta
        },
    )  # fmt: skip


def _kv_b_from_split(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """`kv_b_proj` `[heads * (nope + v), latent]` from llama.cpp's halves, element by
    element as the converter defines them: `k_b[h, c, i]` is row `h * (nope + v) + i`,
    column c; `v_b[h, j, c]` row `h * (nope + v) + nope + j`."""
    heads, latent, nope = k_b.shape
    value = v_b.shape[1]
    kv_b = np.zeros((heads * (nope + value), latent), np.float32)
    for head in range(heads):
        first = head * (nope + value)
        for i in range(nope):
            kv_b[first + i] = k_b[head, :, i]
        for j in range(value):
            kv_b[first + nope + j] = v_b[head, j]
    return kv_b


def write_twin(gguf_path: Path, shape: MlaMoeGgufShape, directory: Path, tokenizer: Path) -> Path:
    """The GGUF's safetensors twin: every tensor of the decoder layers dequantized by
    `gguf`, under transformers' names (per-expert MLPs, the MTP layer left out), the
    config of `_twin_config` and the tokenizer files of `tokenizer`."""
    names = _GLM if shape.architecture == "glm4moe" else _DEEPSEEK
    values: dict[str, np.ndarray] = {}
    for tensor in read_gguf_model(gguf_path).tensors:
        array = dequantize(tensor.data, GGMLQuantizationType[tensor.type_name])
        values[tensor.name] = np.array(
            array.reshape(tuple(reversed(tensor.shape))), np.float32, copy=True
        )
    for layer in range(shape.n_layers):
        k_b = values.pop(f"blk.{layer}.attn_k_b.weight", None)
        v_b = values.pop(f"blk.{layer}.attn_v_b.weight", None)
        if k_b is not None and v_b is not None:
            values[f"blk.{layer}.attn_kv_b.weight"] = _kv_b_from_split(k_b, v_b)
    tensors: dict[str, torch.Tensor] = {}
    for name, array in values.items():
        mtp = re.match(r"^blk\.(\d+)\.", name)
        if mtp is not None and int(mtp.group(1)) >= shape.n_layers:
            continue  # GLM's MTP layer
        block = re.match(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
        if block is None:
            tensors[_TOP[name.removesuffix(".weight")] + ".weight"] = torch.from_numpy(array)
            continue
        layer, kind, part = int(block.group(1)), block.group(2), block.group(3)
        prefix = f"model.layers.{layer}."
        if kind in _EXPERTS:
            for expert, weight in enumerate(array):
                tensors[f"{prefix}mlp.experts.{expert}.{_EXPERTS[kind]}.weight"] = torch.from_numpy(
                    weight.copy()
                )
        elif kind == "exp_probs_b":
            tensors[prefix + "mlp.gate.e_score_correction_bias"] = torch.from_numpy(array)
        else:
            tensors[f"{prefix}{names[kind]}.{part}"] = torch.from_numpy(array)
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    _twin_config(shape).save_pretrained(directory)
    for tokenizer_file in tokenizer.glob("tokenizer*.json"):
        shutil.copy(tokenizer_file, directory / tokenizer_file.name)
    return directory


def logits_of(model_dir: Path) -> torch.Tensor:
    model: Any = load_model(model_dir, make_shard(model_dir, "pipeline", 0, 1), CPU, "float32")
    return engine_greedy(model, PROMPT)[0]


def prepared(gguf_path: Path, models_dir: Path) -> Path:
    """The model of a `.gguf` path as a node prepares it (its card, then conversion),
    after checking the card against the converted config."""
    card = card_for_gguf(gguf_path, f"random-{gguf_path.stem}")
    directory = prepare_model(card, models_dir, offline=True)
    config = json.loads((directory / "config.json").read_text())
    assert card_mismatches(card, config) == ()
    return directory


@pytest.mark.parametrize(
    ("shape", "tensor_type", "kv_b_layout"),
    [
        (DEEPSEEK2_SHAPE, "Q4_K", "split"),
        (GLM4MOE_SHAPE, "Q4_K", "split"),
        pytest.param(DEEPSEEK2_SHAPE, "F32", "split", marks=pytest.mark.slow),
        pytest.param(DEEPSEEK2_SHAPE, "Q8_0", "joint", marks=pytest.mark.slow),
        pytest.param(
            MlaMoeGgufShape(q_lora_rank=0, yarn_factor=0.0), "Q8_0", "split",
            marks=pytest.mark.slow,
        ),
        pytest.param(GLM4MOE_SHAPE, "Q8_0", "split", marks=pytest.mark.slow),
    ],
    ids=["deepseek2-q4k", "glm4moe-q4k", "deepseek2-f32", "deepseek2-joint-kv_b",
         "deepseek2-no-q-lora", "glm4moe-q8"],
)  # fmt: skip
def test_mla_moe_gguf_loads_to_its_dequantized_twins_logits(
    tmp_path: Path, shape: MlaMoeGgufShape, tensor_type: str, kv_b_layout: Any
) -> None:
    files = write_random_mla_moe_gguf(
        tmp_path / f"{shape.architecture}.gguf", shape, tensor_type, kv_b_layout=kv_b_layout
    )
    model_dir = prepared(files[0], tmp_path / "models")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == shape.n_layers  # GLM's MTP layer left out
    assert config["n_group"] == shape.expert_groups
    twin = write_twin(files[0], shape, tmp_path / "twin", model_dir)
    expected, ours = logits_of(twin), logits_of(model_dir)
    assert expected.shape == ours.shape == (64 + 16, shape.vocab_size)
    assert expected.abs().max() > 1.0  # logits that could differ
    assert (ours - expected).abs().max() <= TWIN_TOLERANCE


def test_mla_moe_gguf_card(tmp_path: Path) -> None:
    """The cards state what the converted configs will: MTP layers left out, MLA's ranks
    and heads (not llama.cpp's MQA view), the experts with their shared one and dense
    first layer."""
    deepseek = write_random_mla_moe_gguf(tmp_path / "ds.gguf", DEEPSEEK2_SHAPE, "Q8_0")[0]
    card = card_for_gguf(deepseek, "random-ds")
    assert card.architecture == "DeepseekV3ForCausalLM"
    assert card.num_key_value_heads == DEEPSEEK2_SHAPE.num_attention_heads
    assert card.latent_attention is not None
    assert card.latent_attention.kv_lora_rank == DEEPSEEK2_SHAPE.kv_lora_rank
    assert card.latent_attention.qk_nope_head_dim == DEEPSEEK2_SHAPE.qk_nope_head_dim
    assert card.moe is not None and card.moe.dense_layers == (0,)
    assert card.moe.shared_expert_intermediate_size == DEEPSEEK2_SHAPE.expert_intermediate_size
    glm = write_random_mla_moe_gguf(tmp_path / "glm.gguf", GLM4MOE_SHAPE, "Q8_0")[0]
    card = card_for_gguf(glm, "random-glm")
    assert (card.architecture, card.n_layers) == ("Glm4MoeForCausalLM", GLM4MOE_SHAPE.n_layers)
    assert card.moe is not None and card.moe.correction_bias
    assert card.latent_attention is None


@pytest.mark.parametrize(
    ("old", "new", "error", "named"),
    [
        (b"blk.1.ffn_up_exps", b"blk.1.ffn_up_expx", GgufExpertsError,
         r"blk\.1\.ffn_up_exps\.weight"),
        (b"blk.1.exp_probs_b", b"blk.1.exp_probs_x", GgufExpertsError,
         r"blk\.1\.exp_probs_b\.bias"),
        (b"blk.1.attn_v_b", b"blk.1.attn_v_x", GgufMlaError, r"blk\.1\.attn_v_b\.weight"),
    ],
    ids=["expert", "correction-bias", "mla-half"],
)  # fmt: skip
def test_mla_moe_gguf_without_a_tensor_is_refused_naming_it(
    tmp_path: Path, old: bytes, new: bytes, error: type[Exception], named: str
) -> None:
    path = write_random_mla_moe_gguf(tmp_path / "ds.gguf", DEEPSEEK2_SHAPE, "F32")[0]
    path.write_bytes(path.read_bytes().replace(old, new))
    (tmp_path / "out").mkdir()
    with pytest.raises(error, match=named):
        convert_gguf(path, tmp_path / "out")


def test_mla_moe_gguf_with_a_mis_shaped_expert_tensor_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    """A GGUF whose `expert_feed_forward_length` disagrees with its stacked experts."""
    shape = DEEPSEEK2_SHAPE
    path = write_random_mla_moe_gguf(tmp_path / "ds.gguf", shape, "F32")[0]
    directory = read_gguf_model(path)
    assert directory.metadata["deepseek2.expert_feed_forward_length"] == 256
    data = bytearray(path.read_bytes())
    key = b"deepseek2.expert_feed_forward_length"
    at = data.index(key) + len(key) + 4  # the key, then its u32 value type
    data[at : at + 4] = (128).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    (tmp_path / "out").mkdir()
    with pytest.raises(GgufExpertsError, match=r"blk\.1\.ffn_gate_exps\.weight has shape"):
        convert_gguf(path, tmp_path / "out")


def test_deepseek2_gguf_with_softmax_routing_is_refused_naming_the_key(tmp_path: Path) -> None:
    """DeepSeek-V2's softmax router (`expert_gating_func` 1) is no routing the deepseek_v3
    family computes: the card (what `POST /models/add` answers 400 with) and the conversion
    both name the key."""
    path = write_random_mla_moe_gguf(tmp_path / "ds.gguf", DEEPSEEK2_SHAPE, "F32")[0]
    data = bytearray(path.read_bytes())
    key = b"deepseek2.expert_gating_func"
    at = data.index(key) + len(key) + 4  # the key, then its u32 value type
    assert int.from_bytes(data[at : at + 4], "little") == 2  # sigmoid
    data[at : at + 4] = (1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GgufModelError, match=r"deepseek2\.expert_gating_func is 1 \(softmax\)"):
        card_for_gguf(path, "random-v2")
    (tmp_path / "out").mkdir()
    with pytest.raises(GgufConfigError, match=r"deepseek2\.expert_gating_func"):
        convert_gguf(path, tmp_path / "out")
