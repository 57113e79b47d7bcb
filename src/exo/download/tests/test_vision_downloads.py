"""A vision model's files against the loopback Hub server: the shard whose rank runs the
vision tower (a single rank, or rank 0 of a split) fetches the tower's and projector's
tensors, the other ranks do not; every shard fetches the image-processor configs; a
directory filled before the tower was fetched is completed, not fetched again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from exo.download.completion import missing_files, read_marker
from exo.download.fetch import RetryPolicy
from exo.download.hub_download import HubDownload, download_from_hub
from exo.download.shard_files import is_vision_tensor, tensor_on_shard
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import Sharding, ShardMetadata
from exo.testing.builders import make_card, make_shard
from exo.testing.hf_server import HubServer
from exo.testing.hub_models import save_layered_checkout

REPO = "someone/tiny-vision"
NO_WAIT = RetryPolicy(max_attempts=4, base_delay_seconds=0.0)
# The layered checkout's 6 layers, 2 per file: embedding | layers 0-1 | 2-3 | 4-5 + norm.
EMBEDDING_FILE = "model-00001-of-00004.safetensors"
LAYERS_0_1 = "model-00002-of-00004.safetensors"
LAYERS_2_3 = "model-00003-of-00004.safetensors"
LAYERS_4_5 = "model-00004-of-00004.safetensors"
# The tower and projector in a file of their own (as Gemma 3's and Mistral 3's names have
# them), Idefics3's connector with the embedding, an audio tower nobody reads.
TOWER_FILE = "model-vision.safetensors"
AUDIO_FILE = "model-audio.safetensors"
TOWER_TENSORS = (
    "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
    "vision_tower.vision_model.post_layernorm.weight",
    "multi_modal_projector.mm_input_projection_weight",
)
PROCESSOR_FILES = {"preprocessor_config.json", "processor_config.json"}
TEXT_CARD = make_card(n_layers=6, model_id=REPO)
VISION_CARD = ModelCard.model_validate_json(
    TEXT_CARD.model_copy(
        update={"capabilities": ("text", "vision"), "vision_parameter_count": 3 * 16}
    ).model_dump_json()
)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    directory = save_layered_checkout(tmp_path_factory.mktemp("vision") / "repo")
    generator = torch.Generator().manual_seed(0)
    tower = {name: torch.randn(4, 4, generator=generator) for name in TOWER_TENSORS}
    save_file(tower, str(directory / TOWER_FILE), metadata={"format": "pt"})
    audio = {"audio_tower.encoder.weight": torch.randn(4, 4, generator=generator)}
    save_file(audio, str(directory / AUDIO_FILE), metadata={"format": "pt"})
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(TOWER_TENSORS, TOWER_FILE))
    index["weight_map"]["audio_tower.encoder.weight"] = AUDIO_FILE
    index_path.write_text(json.dumps(index, indent=2))
    (directory / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 896}}))
    (directory / "processor_config.json").write_text(json.dumps({"image_seq_length": 256}))
    return directory


@pytest.fixture
def hub(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_directory(REPO, checkout)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent/exo-test-token")
        yield server


def shard(
    rank: int, world_size: int, sharding: Sharding = "pipeline", card: ModelCard = VISION_CARD
) -> ShardMetadata:
    return make_shard(card, sharding, device_rank=rank, world_size=world_size)


def fetch(directory: Path, shard: ShardMetadata | None) -> Path:
    return download_from_hub(HubDownload(REPO, REPO, "main", shard, directory), policy=NO_WAIT)


def fetched(hub: HubServer) -> set[str]:
    return set(hub.files_downloaded(REPO))


def weights(hub: HubServer) -> set[str]:
    return {name for name in fetched(hub) if name.endswith(".safetensors")}


def test_rank_0_of_a_pipeline_fetches_the_tower_and_the_other_ranks_do_not(
    hub: HubServer, checkout: Path, tmp_path: Path
) -> None:
    first = fetch(tmp_path / "rank0", shard(0, 3))
    assert weights(hub) == {EMBEDDING_FILE, LAYERS_0_1, TOWER_FILE}
    assert (first / TOWER_FILE).read_bytes() == (checkout / TOWER_FILE).read_bytes()
    assert fetched(hub) >= PROCESSOR_FILES
    assert missing_files(first, shard(0, 3)) == []
    before = weights(hub)
    for rank, layers_file in ((1, LAYERS_2_3), (2, LAYERS_4_5)):
        directory = fetch(tmp_path / f"rank{rank}", shard(rank, 3))
        assert (directory / layers_file).exists() and not (directory / TOWER_FILE).exists()
        # The processor configs too: the API on any node counts image tokens with them.
        assert all((directory / name).exists() for name in PROCESSOR_FILES)
        assert missing_files(directory, shard(rank, 3)) == []
        # Rank 0 of the same split would lack the tower (and its layers) there.
        assert TOWER_FILE in (missing_files(directory, shard(0, 3)) or [])
    assert weights(hub) - before == {LAYERS_2_3, LAYERS_4_5}
    assert AUDIO_FILE not in fetched(hub)


def test_tensor_rank_0_fetches_every_weight_file_and_the_tower_rank_1_all_but_the_tower(
    hub: HubServer, tmp_path: Path
) -> None:
    text_files = {EMBEDDING_FILE, LAYERS_0_1, LAYERS_2_3, LAYERS_4_5}
    fetch(tmp_path / "rank1", shard(1, 2, "tensor"))
    assert weights(hub) == text_files
    fetch(tmp_path / "rank0", shard(0, 2, "tensor"))
    assert weights(hub) == text_files | {TOWER_FILE}


def test_a_single_node_fetches_the_tower_a_text_card_does_not(
    hub: HubServer, tmp_path: Path
) -> None:
    text_files = {EMBEDDING_FILE, LAYERS_0_1, LAYERS_2_3, LAYERS_4_5}
    fetch(tmp_path / "text", shard(0, 1, card=TEXT_CARD))
    assert weights(hub) == text_files  # the engine runs no tower for a text card
    directory = fetch(tmp_path / "vision", shard(0, 1))
    assert weights(hub) == text_files | {TOWER_FILE}
    assert (directory / TOWER_FILE).exists() and not (directory / AUDIO_FILE).exists()


def test_the_whole_model_fetches_the_tower_but_no_audio(hub: HubServer, tmp_path: Path) -> None:
    fetch(tmp_path / "model", None)
    assert TOWER_FILE in weights(hub) and AUDIO_FILE not in weights(hub)


def test_a_directory_filled_without_the_tower_is_completed_with_only_what_it_lacks(
    hub: HubServer, tmp_path: Path
) -> None:
    """A rank 0 whose files came before towers and processor configs were fetched (its
    marker lists neither) asks for them alone, not for the files it holds."""
    directory = fetch(tmp_path / "model", shard(0, 3))
    marker = read_marker(directory)
    assert marker is not None
    for name in (TOWER_FILE, *PROCESSOR_FILES):
        del marker["files"][name]
        (directory / name).unlink()
    (directory / ".exo-complete").write_text(json.dumps(marker))
    assert sorted(missing_files(directory, shard(0, 3)) or []) == sorted(
        [TOWER_FILE, *PROCESSOR_FILES]
    )
    before = len(hub.requests)
    fetch(directory, shard(0, 3))
    again = {r.filename for r in hub.requests[before:] if "/resolve/" in r.path}
    assert again == {TOWER_FILE, *PROCESSOR_FILES}
    assert missing_files(directory, shard(0, 3)) == []


@pytest.mark.parametrize(
    ("name", "vision"),
    [
        ("vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight", True),
        ("model.vision_tower.vision_model.embeddings.patch_embedding.weight", True),
        ("multi_modal_projector.linear_1.weight", True),
        ("model.vision_model.encoder.layers.0.mlp.fc1.weight", True),  # Idefics3 / SmolVLM
        ("model.connector.modality_projection.proj.weight", True),
        ("visual.blocks.0.attn.qkv.weight", True),  # Qwen2.5-VL
        ("model.visual.merger.mlp.0.weight", True),
        ("model.layers.0.self_attn.q_proj.weight", False),
        ("language_model.model.embed_tokens.weight", False),
        ("model.text_model.layers.0.mlp.up_proj.weight", False),
        ("lm_head.weight", False),
    ],
)
def test_which_tensors_are_the_vision_towers(name: str, vision: bool) -> None:
    assert is_vision_tensor(name) == vision
    # Only rank 0 of a vision card's split loads them; every rank of a text card skips them.
    if vision:
        assert tensor_on_shard(name, shard(0, 2))
        assert not tensor_on_shard(name, shard(1, 2))
        assert not tensor_on_shard(name, shard(0, 2, card=TEXT_CARD))


def test_rank_0s_files_load_a_gemma3_tower_and_rank_1s_do_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own tower loader on what each rank of a two-rank pipeline downloaded
    from a Gemma 3 checkout whose tower and projector sit in a file of their own."""
    from safetensors.torch import save_file
    from transformers import Gemma3Config

    from exo.worker.engines.torch.model.gemma3_vision import Gemma3VisionEncoder
    from exo.worker.engines.torch.model.loading import model_config

    torch.manual_seed(0)
    config = Gemma3Config(
        text_config={
            "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16,
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
        },
        mm_tokens_per_image=4,
    )  # fmt: skip
    tower = Gemma3VisionEncoder.from_config(config)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    # The text model's names as the 4B+ checkpoints publish them (only their names matter
    # here: which file each rank fetches), one file per layer; the tower's in its own.
    text = {
        "language_model.model.embed_tokens.weight": torch.zeros(64, 32),
        "language_model.model.layers.0.mlp.up_proj.weight": torch.zeros(48, 32),
        "language_model.model.layers.1.mlp.up_proj.weight": torch.zeros(48, 32),
        "language_model.model.norm.weight": torch.zeros(32),
    }
    files = {
        "model-00001-of-00003.safetensors": dict(list(text.items())[:2]),
        "model-00002-of-00003.safetensors": dict(list(text.items())[2:]),
        "model-00003-of-00003.safetensors": {
            name: tensor.detach().clone().contiguous()
            for name, tensor in tower.state_dict().items()
        },
    }
    weight_map: dict[str, str] = {}
    for file_name, tensors in files.items():
        save_file(tensors, str(checkout / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
    index = {"metadata": {}, "weight_map": weight_map}
    (checkout / "model.safetensors.index.json").write_text(json.dumps(index))
    saved = config.to_dict() | {"architectures": ["Gemma3ForConditionalGeneration"]}
    (checkout / "config.json").write_text(json.dumps(saved))
    (checkout / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 32}}))
    card = ModelCard.model_validate_json(
        make_card(n_layers=2, model_id="someone/tiny-gemma3-vision")
        .model_copy(update={"capabilities": ("text", "vision")})
        .model_dump_json()
    )
    with HubServer() as server:
        server.add_directory(str(card.model_id), checkout)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent/exo-test-token")
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        directories = []
        for rank in range(2):
            download = HubDownload(
                str(card.model_id), str(card.model_id), "main",
                make_shard(card, "pipeline", device_rank=rank, world_size=2),
                tmp_path / f"rank{rank}",
            )  # fmt: skip
            directories.append(download_from_hub(download, policy=NO_WAIT))
    first, second = directories
    loaded = Gemma3VisionEncoder.load(first, model_config(first))
    for name, tensor in tower.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert (second / "preprocessor_config.json").exists()
    with pytest.raises(ValueError, match="vision tensors missing"):
        Gemma3VisionEncoder.load(second, model_config(second))
