"""Which generation failures of a split instance are another rank leaving (a 503 the API
retries, one log line) rather than a failure of this rank."""

import pytest
import torch.distributed

from exo.worker.runner.failures import peer_failure


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
            "Connection closed by peer [127.0.0.1]:40123"
        ),
        RuntimeError("Connection reset by peer"),
        torch.distributed.DistNetworkError("the store is gone"),
    ],
)
def test_a_rank_leaving_is_a_peer_failure(error: Exception) -> None:
    assert peer_failure(error)


@pytest.mark.parametrize(
    "error", [RuntimeError("CUDA out of memory"), KeyError("lm_head.weight"), ValueError("bad")]
)
def test_other_failures_are_not(error: Exception) -> None:
    assert not peer_failure(error)
