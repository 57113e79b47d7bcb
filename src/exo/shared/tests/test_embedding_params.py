"""`EmbeddingTaskParams` refuses what no model could answer."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from exo.shared.types.common import ModelId
from exo.shared.types.embeddings import EmbeddingTaskParams

MODEL = ModelId("some/model")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"inputs": ()}, "at least 1 item"),
        ({"inputs": ((),)}, "at least one token"),
        ({"kind": "rerank", "inputs": ("doc",)}, "needs a query"),
        ({"kind": "rerank", "inputs": ((1, 2),), "query": "q"}, "documents are text"),
        ({"inputs": ("a",), "dimensions": 0}, "greater than 0"),
    ],
)
def test_refusals(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EmbeddingTaskParams(model=MODEL, **fields)  # type: ignore[arg-type]


def test_text_and_token_inputs_are_kept_in_order() -> None:
    params = EmbeddingTaskParams(model=MODEL, inputs=("a", (1, 2)))
    assert params.inputs == ("a", (1, 2)) and params.kind == "embed" and not params.truncate
