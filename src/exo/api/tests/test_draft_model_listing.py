"""A card's draft model (issue 43) where the API shows cards: the card JSON of `/models`
carries `draft_model`, and Ollama's `/api/show` lists it as `exo.draft_model` in
`model_info` (only for a card that names one); `/instance/previews` names the draft and
its node."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from exo.api.app import create_app
from exo.api.ollama.model_listings import show_response
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.testing.in_process import NODE, in_process_cluster


def test_the_cards_draft_model_shows_in_the_card_json_and_in_show() -> None:
    cards = load_builtin_cards()
    target = cards[ModelId("Qwen/Qwen3-8B")]
    assert target.model_dump(mode="json")["draft_model"] == "Qwen/Qwen3-0.6B"
    shown = show_response(target, "", "2026-12-06T00:00:00Z", False)
    assert shown.model_info["exo.draft_model"] == "Qwen/Qwen3-0.6B"
    draft = show_response(cards[ModelId("Qwen/Qwen3-0.6B")], "", "x", False)
    assert "exo.draft_model" not in draft.model_info


@pytest.mark.anyio
async def test_the_previews_route_names_the_draft_and_its_node(tmp_path: Path) -> None:
    async with in_process_cluster(tmp_path, cards=load_builtin_cards()) as cluster:
        cluster.report_node(available_mb=32 * 1024)
        with anyio.fail_after(10):
            while NODE not in cluster.client.state.node_info:
                await anyio.sleep(0.01)
        transport = httpx.ASGITransport(app=create_app(cluster.client))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            answer = await http.get("/instance/previews", params={"model_id": "qwen3:8b"})
    assert answer.status_code == 200, answer.text
    first = answer.json()[0]
    assert (first["sharding"], first["node_count"], first["error"]) == ("pipeline", 1, None)
    assert first["draft"]["model_id"] == "Qwen/Qwen3-0.6B"
    assert first["draft"]["node_id"] == NODE and first["draft"]["chosen_by"] == "card"
    assert first["draft_left_out"] is None
