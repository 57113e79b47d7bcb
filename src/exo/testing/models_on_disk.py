"""Models laid out on disk as other tools leave them, for the tests of
`exo.download.on_disk`: a Hugging Face cache repository, a models directory's copy, a
catalog-like card with a Hub source."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from exo.shared.types.models import HuggingFaceSource, ModelCard
from exo.testing.builders import make_card

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CATALOG_REPO = "someorg/catalog-model"


def write_checkout(directory: Path, architecture: str = "LlamaForCausalLM") -> Path:
    """The files a whole copy is judged by (their content is never loaded here)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    (directory / "tokenizer.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights")
    return directory


def hub_cache_copy(
    cache: Path, repo_id: str, architecture: str = "LlamaForCausalLM", commit: str = COMMIT
) -> Path:
    """A repository laid out as the Hugging Face cache keeps it: `blobs/`, a snapshot of
    links into them, `refs/main` naming the commit."""
    repository = cache / f"models--{repo_id.replace('/', '--')}"
    checkout = write_checkout(cache.parent / "checkouts" / repo_id, architecture)
    snapshot = repository / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repository / "blobs").mkdir()
    for path in checkout.iterdir():
        blob = repository / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        blob.write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    return snapshot


def catalog_card(repo_id: str = CATALOG_REPO) -> ModelCard:
    card = make_card(model_id=repo_id)
    update = {"source": HuggingFaceSource(repo_id=repo_id, revision=COMMIT)}
    return ModelCard.model_validate_json(card.model_copy(update=update).model_dump_json())
