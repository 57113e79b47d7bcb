"""The `/openapi.json` document equals the committed golden file, so moving the API's code
around cannot change what clients and generators see. After an intended change to the
document, regenerate the file: `python -m exo.api.tests.test_openapi_golden`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient

GOLDEN_PATH = Path(__file__).with_name("openapi_golden.json")


def live_document() -> dict[str, Any]:
    # Building the document reaches no handler: no request below reaches the cluster.
    with TestClient(create_app(cast(ClusterClient, object()))) as test_client:
        response = test_client.get("/openapi.json")
    assert response.status_code == 200, response.text
    return cast(dict[str, Any], response.json())


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def test_openapi_document_equals_golden_file() -> None:
    live = render(live_document())
    golden = GOLDEN_PATH.read_text(encoding="utf-8")
    assert live == golden, (
        "the /openapi.json document changed; if on purpose, regenerate "
        "src/exo/api/tests/openapi_golden.json with "
        "`python -m exo.api.tests.test_openapi_golden` and say why in the commit"
    )


if __name__ == "__main__":
    GOLDEN_PATH.write_text(render(live_document()), encoding="utf-8")
