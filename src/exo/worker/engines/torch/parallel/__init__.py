"""Each parallelism's engine side, one file per kind, looked up by the shard's `sharding`:
how the meta skeleton is cut, how a rank reads its tensors, how a step travels between the
ranks (`base.EngineTransform`), and what the ranks exchange for a step (`rank_steps`; the KV
operations rank 0 decided, `cache_ops`).

A new kind is one file here and its torch-free description in `exo.shared.parallelism`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from exo.worker.engines.torch.parallel.base import EngineTransform
from exo.worker.engines.torch.parallel.expert import ExpertTransform
from exo.worker.engines.torch.parallel.pipeline import PipelineTransform
from exo.worker.engines.torch.parallel.tensor import TensorTransform

if TYPE_CHECKING:
    from exo.shared.types.shards import Sharding

TRANSFORMS: Mapping[Sharding, EngineTransform] = {
    "pipeline": PipelineTransform(),
    "tensor": TensorTransform(),
    "expert": ExpertTransform(),
}


def engine_transform(sharding: Sharding) -> EngineTransform:
    """The engine side of `sharding`."""
    return TRANSFORMS[sharding]
