"""Every `Sharding` value has one engine transform, of its own kind, whose description is
the shared one (`exo.shared.parallelism`)."""

from __future__ import annotations

from typing import get_args

from exo.shared.parallelism import parallelism
from exo.shared.types.shards import Sharding
from exo.worker.engines.torch.parallel import TRANSFORMS, engine_transform


def test_every_sharding_value_has_one_engine_transform() -> None:
    assert set(TRANSFORMS) == set(get_args(Sharding))
    for sharding in get_args(Sharding):
        transform = engine_transform(sharding)
        assert transform.sharding == sharding
        assert transform.description is parallelism(sharding)
