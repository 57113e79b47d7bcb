"""Each parallelism described in one place, looked up by its `Sharding` value.

Placement, recovery, downloads, memory accounting and speed prediction ask the description
(`parallelism(shard.sharding)`) instead of testing the kind; a new kind is one module here
(and its engine transform in `exo.worker.engines.torch.parallel`). A test
(`shared/tests/test_parallelism_kind_tests.py`) fails when code elsewhere tests the kind.
"""

from __future__ import annotations

from collections.abc import Mapping

from exo.shared.parallelism.base import Parallelism as Parallelism
from exo.shared.parallelism.base import Sharding as Sharding
from exo.shared.parallelism.base import StepNetwork as StepNetwork
from exo.shared.parallelism.expert import ExpertParallelism
from exo.shared.parallelism.pipeline import PipelineParallelism
from exo.shared.parallelism.tensor import TensorParallelism

PARALLELISMS: Mapping[Sharding, Parallelism] = {
    "pipeline": PipelineParallelism(),
    "tensor": TensorParallelism(),
    "expert": ExpertParallelism(),
}


def parallelism(sharding: Sharding) -> Parallelism:
    """The description of `sharding`."""
    return PARALLELISMS[sharding]
