"""GGUF files and Ollama's store as models: names, cards from GGUF metadata, converted once
into a writable models directory with no request anywhere, listed and addressed by their
Ollama name through the API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from exo.api.app import create_app
from exo.download import pypi_gguf
from exo.download.gguf_models import (
    GgufModelError,
    card_for_gguf,
    ollama_store_cards,
    ollama_store_models,
)
from exo.download.pypi_gguf import ModelPreparationError, prepare_model
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.commands import AddCustomModel
from exo.shared.types.common import CommandId
from exo.shared.types.models import GgufFileSource, GgufWeightTypes
from exo.testing.hf_server import HubServer
from exo.testing.in_process import in_process_cluster
from exo.testing.random_gguf import RandomGgufShape, write_random_gguf
from exo.testing.tiny_gguf import add_to_ollama_store, save_tiny_gguf

CATALOG = load_builtin_cards()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def store(tmp_path: Path, tiny_gguf: Path) -> Path:
    root = tmp_path / "ollama" / "models"
    add_to_ollama_store(root, "mytiny", "latest", tiny_gguf)
    # A name the catalog answers to stays the catalog's.
    add_to_ollama_store(root, "qwen3", "0.6b", tiny_gguf)
    (root / "manifests" / "registry.ollama.ai" / "library" / "broken").mkdir(parents=True)
    (root / "manifests" / "registry.ollama.ai" / "library" / "broken" / "v1").write_text("{")
    return root


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubServer]:
    """A Hub nobody should ask."""
    with HubServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.delenv("EXO_MODELS_DIRS", raising=False)
        monkeypatch.delenv("EXO_MODELS_READ_ONLY_DIRS", raising=False)
        yield server


def test_the_store_lists_models_by_their_ollama_names(store: Path) -> None:
    models = {model.name: model for model in ollama_store_models(store)}
    assert set(models) == {"mytiny:latest", "qwen3:0.6b"}
    assert models["mytiny:latest"].gguf_path.parent == store / "blobs"
    cards, skipped = ollama_store_cards(store, CATALOG)
    assert [card.model_id for card in cards] == ["mytiny:latest"]
    assert len(skipped) == 1 and skipped[0].startswith("qwen3:0.6b: the catalog model")


def test_a_card_comes_from_the_gguf_metadata(tiny_gguf: Path) -> None:
    card = card_for_gguf(tiny_gguf, "mytiny:latest", "ab" * 32)
    assert card.architecture == "LlamaForCausalLM"
    assert (card.n_layers, card.hidden_size, card.num_attention_heads) == (2, 64, 4)
    assert (card.num_key_value_heads, card.intermediate_size, card.vocab_size) == (2, 128, 64)
    assert card.context_length == 512 and card.has_chat_template
    assert card.storage_size_bytes == tiny_gguf.stat().st_size
    assert card.source == GgufFileSource(path=str(tiny_gguf), sha256="ab" * 32)
    # 2 layers x (64 x (64 + 32 + 32 + 64) + 3 x 64 x 128) float32 linear weights, F32 head.
    assert card.gguf_weight_types == GgufWeightTypes(
        layer_weights=(("F32", 73728),), output_type="F32"
    )


def test_a_card_records_the_types_the_gguf_stores_its_weights_in(tmp_path: Path) -> None:
    shape = RandomGgufShape()  # hidden 128, 2 layers, heads 4 x 32, 2 KV heads, MLP 256
    path = write_random_gguf(tmp_path / "q8.gguf", shape, tensor_type="Q8_0", embedding_type="Q4_1")
    card = card_for_gguf(path, "q8")
    per_layer = 128 * (128 + 64 + 64 + 128) + 3 * 128 * 256
    assert card.gguf_weight_types == GgufWeightTypes(
        layer_weights=(("Q8_0", 2 * per_layer),), output_type="Q4_1"
    )


@pytest.mark.parametrize(
    ("file_type", "name"), [(15, "Q4_K_M"), (3, "Q4_1"), (38, "MXFP4"), (19, None), (None, None)]
)
def test_a_card_names_the_gguf_file_type_as_ollama_does(
    tmp_path: Path, file_type: int | None, name: str | None
) -> None:
    """`general.file_type` by Ollama's name for it (None for an id Ollama names no type,
    like 19, IQ2_XXS, or for none at all)."""
    path = write_random_gguf(tmp_path / "typed.gguf", RandomGgufShape(), file_type=file_type)
    stored = card_for_gguf(path, "typed").gguf_weight_types
    assert stored is not None and stored.file_type == name


def test_a_file_that_is_no_gguf_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GgufModelError, match="not a readable GGUF"):
        card_for_gguf(bogus, "bogus")


def test_a_store_model_converts_once_with_no_request(
    store: Path, tiny_gguf: Path, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    [card], _ = ollama_store_cards(store, CATALOG)
    models = tmp_path / "models"
    directory = prepare_model(card, models, offline=True)
    assert directory == models / "mytiny:latest"
    converted = load_file(str(directory / "model.safetensors"))
    original = load_file(str(tiny_gguf.with_suffix(".checkout") / "model.safetensors"))
    assert set(original) <= set(converted)
    for name, tensor in original.items():
        np.testing.assert_allclose(converted[name], tensor, rtol=0, atol=1e-6)

    def no_second_conversion(*_args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(pypi_gguf, "convert_gguf_to_safetensors", no_second_conversion)
    assert prepare_model(card, models, offline=True) == directory
    assert hub.requests == []
    assert [path.name for path in models.iterdir()] == ["mytiny:latest"]


def test_a_gguf_with_the_wrong_sha256_is_not_converted(
    tiny_gguf: Path, hub: HubServer, tmp_path: Path
) -> None:
    card = card_for_gguf(tiny_gguf, "mytiny:latest", "00" * 32)
    with pytest.raises(ModelPreparationError, match="expected 0000"):
        prepare_model(card, tmp_path / "models", offline=False)
    assert not (tmp_path / "models" / "mytiny:latest").exists()


@pytest.mark.anyio
async def test_a_store_model_is_listed_and_addressed_by_its_ollama_name(
    store: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    [card], _ = ollama_store_cards(store, CATALOG)
    async with in_process_cluster(tmp_path) as cluster:
        await cluster.client.submit(AddCustomModel(command_id=CommandId.new(), card=card))
        transport = httpx.ASGITransport(app=create_app(cluster.client))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            listed = [model["model_id"] for model in (await http.get("/models")).json()]
            assert "mytiny:latest" in listed
            found = await http.get("/v1/models/mytiny:latest")
            assert found.status_code == 200 and found.json()["id"] == "mytiny:latest"
            added = await http.post("/models/add", json={"model_id": str(store / "absent.gguf")})
            assert added.status_code == 404
            by_path = await http.post("/models/add", json={"model_id": str(tiny_gguf)})
            assert by_path.status_code == 200, by_path.text
            assert by_path.json()["card"]["source"]["kind"] == "GgufFileSource"
            assert str(tiny_gguf) in cluster.state.custom_cards


def _converted_embedding(directory: Path) -> np.ndarray:
    converted = load_file(str(directory / "model.safetensors"))
    return next(tensor for name, tensor in converted.items() if "embed_tokens" in name)


def test_two_paths_sharing_a_directory_name_get_their_own_weights(tmp_path: Path) -> None:
    """`/m/a--b.gguf` and `/m--a/b.gguf` map to one directory name (`/` becomes `--`): each
    is served from a conversion of itself, never of the other (the marker's source path is
    checked), the second replacing the first's conversion."""
    shape = RandomGgufShape()
    (tmp_path / "m").mkdir()
    (tmp_path / "m--a").mkdir()
    first = write_random_gguf(tmp_path / "m" / "a--b.gguf", shape, seed=1)
    second = write_random_gguf(tmp_path / "m--a" / "b.gguf", shape, seed=2)
    cards = [card_for_gguf(path, str(path)) for path in (first, second)]
    models = tmp_path / "models"
    one = _converted_embedding(prepare_model(cards[0], models, offline=True))
    two = _converted_embedding(prepare_model(cards[1], models, offline=True))
    assert not np.array_equal(one, two)
    assert np.array_equal(_converted_embedding(prepare_model(cards[0], models, offline=True)), one)


def test_a_gguf_replaced_in_place_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = RandomGgufShape()
    path = write_random_gguf(tmp_path / "tiny.gguf", shape, seed=1)
    card = card_for_gguf(path, str(path))
    models = tmp_path / "models"
    before = _converted_embedding(prepare_model(card, models, offline=True))
    write_random_gguf(path, shape, seed=2)
    after = _converted_embedding(prepare_model(card, models, offline=True))
    assert not np.array_equal(before, after)

    def no_third_conversion(*_args: object) -> None:
        raise AssertionError("an unchanged file converted again")

    monkeypatch.setattr(pypi_gguf, "convert_gguf_to_safetensors", no_third_conversion)
    assert np.array_equal(_converted_embedding(prepare_model(card, models, offline=True)), after)


def test_a_conversion_holds_its_gguf_until_the_file_changes(tmp_path: Path) -> None:
    """`holds_current_source`, which the worker asks before each load: true of a
    conversion of the file as it is, false once the file is replaced (same size: its
    modification time tells), true again when the file is gone (its last conversion is
    all there is) and of every source that cannot change under its card."""
    shape = RandomGgufShape()
    path = write_random_gguf(tmp_path / "tiny.gguf", shape, seed=1)
    card = card_for_gguf(path, str(path))
    directory = prepare_model(card, tmp_path / "models", offline=True)
    assert pypi_gguf.holds_current_source(card, directory)
    size = path.stat().st_size
    write_random_gguf(path, shape, seed=2)
    assert path.stat().st_size == size
    assert not pypi_gguf.holds_current_source(card, directory)
    path.unlink()
    assert pypi_gguf.holds_current_source(card, directory)
    assert pypi_gguf.holds_current_source(CATALOG[next(iter(CATALOG))], tmp_path / "absent")
