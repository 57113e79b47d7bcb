"""`GET /metrics`: this node's Prometheus metrics (`exo.api.serving.metrics`), in the text
format."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from exo.api.serving.metrics import ApiMetrics

router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Every metric of this node, in Prometheus' text exposition format."""
    node_metrics: ApiMetrics = request.app.state.metrics
    return Response(generate_latest(node_metrics.registry), media_type=CONTENT_TYPE_LATEST)
