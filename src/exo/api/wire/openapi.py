"""The OpenAPI document as the API really answers: a body that does not match the schema is
a 400 in the route's dialect, not FastAPI's 422 with its own `HTTPValidationError` shape."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from typing import Any

from exo.api.wire.errors import ErrorDialect

BAD_REQUEST_DESCRIPTION = (
    "Bad request: the body is not JSON, does not match the schema, or asks for something "
    "this server does not do. The message names the parameter at fault."
)
FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def with_bad_request_responses(
    schema: Mapping[str, Any], dialect_for: Callable[[str], ErrorDialect]
) -> dict[str, Any]:
    """A copy of `schema` (an OpenAPI document from FastAPI) where every operation's 422
    response is replaced by a 400 whose example is the error body of the path's dialect.
    FastAPI's validation-error schemas are dropped once nothing refers to them.

    Args:
        schema: the document `fastapi.openapi.utils.get_openapi` built (not modified).
        dialect_for: the error dialect of a route path.
    """
    document = copy.deepcopy(dict(schema))
    for path, operations in document.get("paths", {}).items():
        example = dialect_for(path).render(
            400, "invalid_request_error", "messages: Field required", "messages", None
        )
        for method, operation in operations.items():
            responses = operation.get("responses") if method in HTTP_METHODS else None
            if not responses or "422" not in responses:
                continue
            del responses["422"]
            responses.setdefault(
                "400",
                {
                    "description": BAD_REQUEST_DESCRIPTION,
                    "content": {
                        "application/json": {"schema": {"type": "object"}, "example": example}
                    },
                },
            )
    if "#/components/schemas/HTTPValidationError" not in json.dumps(document.get("paths", {})):
        schemas = document.get("components", {}).get("schemas", {})
        for name in FASTAPI_VALIDATION_SCHEMAS:  # the second is only used by the first
            schemas.pop(name, None)
    return document
