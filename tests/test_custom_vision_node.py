"""A vision checkpoint added with `POST /models/add` of a local directory answers a chat
request with an image on a real `exo` node (its card gets the `vision` capability, the
runner loads the tower, the image's soft tokens are counted in the prompt).

Found by trial 40: such a card had capabilities `["text"]`, so every image was refused
with 400 "the model has no vision capability".
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx

from exo.testing.processes import ExoNode
from exo.testing.vision_checkpoints import png, save_gemma3_checkout, tiny_gemma3_vision


def _chat(node: ExoNode, model_id: str, content: object) -> httpx.Response:
    return httpx.post(
        f"{node.url}/v1/chat/completions",
        json={
            "model": model_id,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
            "temperature": 0,
        },
        timeout=120,
    )


def test_an_image_reaches_a_vision_model_added_from_a_local_directory(tmp_path: Path) -> None:
    _, text, encoder = tiny_gemma3_vision()
    directory = save_gemma3_checkout(tmp_path / "gemma3-vision", text, encoder)
    node = ExoNode(tmp_path / "node", extra_args=("--no-default-model",))
    try:
        node.start()
        model_id, _ = node.serve_local_model(directory)
        card = node.state()["custom_cards"][model_id]
        assert "vision" in card["capabilities"] and card["vision_parameter_count"] > 0
        image = base64.b64encode(png(32, 32, seed=1)).decode()
        with_image = _chat(
            node,
            model_id,
            [
                {"type": "text", "text": "w1 w2"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
            ],
        )
        assert with_image.status_code == 200, with_image.text
        without = _chat(node, model_id, "w1 w2")
        assert without.status_code == 200, without.text
        # The image's soft tokens (4 in this tiny tower) and its begin/end marks are prompt.
        extra = (
            with_image.json()["usage"]["prompt_tokens"] - without.json()["usage"]["prompt_tokens"]
        )
        assert extra >= 4, (with_image.json()["usage"], without.json()["usage"])
    finally:
        node.stop()
