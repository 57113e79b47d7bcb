"""The names a client may use for a catalog model, and which model a name means.

A card answers to its Hugging Face id (`Qwen/Qwen3-0.6B`, any letter case), its Ollama-style
short name (`qwen3:0.6b`), the same with a dash (`qwen3-0.6b`), and the repository name
alone (`Qwen3-0.6B`) when no other card shares it; each also with Ollama's default tag
`:latest` appended. Pure functions: the API routes of every dialect call `resolve_model_name`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard

LATEST_TAG = ":latest"


def card_names(card: ModelCard) -> tuple[str, ...]:
    """The lower-case names `card` answers to (its id first)."""
    names = [card.model_id.lower()]
    if card.short_name is not None:
        names += [card.short_name, card.short_name.replace(":", "-")]
    return tuple(dict.fromkeys(names))


def dash_short_name(card: ModelCard) -> str | None:
    """`qwen3:0.6b` -> `qwen3-0.6b` (None when the card has no short name)."""
    return card.short_name.replace(":", "-") if card.short_name is not None else None


def _repository_names(cards: Iterable[ModelCard]) -> dict[str, ModelId | None]:
    """Lower-case repository name (the part after `org/`) -> id; None when ambiguous."""
    by_name: dict[str, ModelId | None] = {}
    for card in cards:
        if "/" not in card.model_id:
            continue
        name = card.model_id.rsplit("/", 1)[1].lower()
        by_name[name] = None if name in by_name else card.model_id
    return by_name


def resolve_model_name(
    name: str,
    cards: Mapping[ModelId, ModelCard],
    other_ids: Iterable[str] = (),
    custom_cards: Mapping[ModelId, ModelCard] | None = None,
) -> ModelId | None:
    """The model `name` means, or None.

    Args:
        name: What the client sent as the model.
        cards: The catalog, by id.
        other_ids: Ids of models known without a catalog card (placed custom models); they
            match exactly only.
        custom_cards: Models added outside the catalog (`State.custom_cards`). They answer
            to their names like catalog cards, but only to names no catalog card answers
            to: adding `someone/Qwen3-0.6B` leaves `Qwen3-0.6B` meaning the catalog's.

    Returns:
        The canonical model id.
    """
    if not name:
        return None
    found = _resolve(name, cards, other_ids)
    if found is None and custom_cards:
        found = _resolve(name, custom_cards, ())
    return found


def _resolve(
    name: str, cards: Mapping[ModelId, ModelCard], other_ids: Iterable[str]
) -> ModelId | None:
    if name in cards:
        return ModelId(name)
    others = set(other_ids)
    if name in others:
        return ModelId(name)
    candidates = [name, name.removesuffix(LATEST_TAG)]
    if name.endswith(LATEST_TAG) and candidates[1] in others:
        return ModelId(candidates[1])
    # Test doubles may map an id to no card; only real cards have other names.
    present = [card for card in cards.values() if card is not None]
    by_name = {alias: card.model_id for card in present for alias in card_names(card)}
    repositories = _repository_names(present)
    for candidate in candidates:
        key = candidate.lower()
        if key in by_name:
            return by_name[key]
        if repositories.get(key) is not None:
            return repositories[key]
    return None


def duplicate_names(cards: Iterable[ModelCard]) -> dict[str, list[ModelId]]:
    """Names (see `card_names`) claimed by more than one card: name -> ids."""
    claimed: dict[str, list[ModelId]] = {}
    for card in cards:
        for alias in card_names(card):
            claimed.setdefault(alias, []).append(card.model_id)
    return {alias: ids for alias, ids in claimed.items() if len(ids) > 1}
