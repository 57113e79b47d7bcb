"""How long a request waited for its model to load: Ollama's `load_duration`.

Ollama reports, with each generation, the time it spent loading the model for that
request (0 when the model was loaded already). Here a request waits for a load when no
instance of its model was ready (every rank `RunnerReady` / `RunnerRunning`:
`keep_alive.instance_ready`) as it arrived: it placed the model on request, joined a
placement or a load under way, or waited for an instance being placed again after a node
loss. Its wait ends when this node's state first shows an instance of the model ready
(`ReadyTimes`, kept by the cluster client as events are applied), or at its first chunk
if that comes first (the ready event may reach this node after the runner's first token,
which travels straight to it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exo.master.keep_alive import instance_ready
from exo.shared.types.common import InstanceId, ModelId
from exo.shared.types.state import State


@dataclass(slots=True)
class ReadyTimes:
    """When this node saw each ready instance become ready (monotonic nanoseconds).

    An instance placed again (new runners, not ready) leaves the record, so its next
    readiness is a new time; a deleted one leaves it too."""

    _since_ns: dict[InstanceId, tuple[ModelId, int]] = field(default_factory=dict)

    def observe(self, state: State, now_ns: int) -> None:
        """Note the instances of `state` that are ready now and were not before."""
        ready: dict[InstanceId, tuple[ModelId, int]] = {}
        for instance_id, instance in state.instances.items():
            if instance_ready(state, instance):
                ready[instance_id] = self._since_ns.get(instance_id, (instance.model_id, now_ns))
        self._since_ns = ready

    def first_ready_at_or_after(self, model: ModelId, start_ns: int) -> int | None:
        """The earliest time at or after `start_ns` an instance of `model` still ready
        became ready; None when none did."""
        times = [
            since
            for instance_model, since in self._since_ns.values()
            if instance_model == model and since >= start_ns
        ]
        return min(times, default=None)


def model_ready(state: State, model: ModelId | None) -> bool:
    """Whether an instance of `model` (None: a name this node cannot resolve yet) is ready
    to take a request now."""
    if model is None:
        return False
    return any(instance_ready(state, instance) for instance in state.instances_of_model(model))


@dataclass(frozen=True, slots=True)
class LoadWait:
    """One request's wait for its model to load.

    Args:
        model: the model it asked for.
        started_ns: when it arrived (monotonic nanoseconds).
        ready_times: the cluster client's record, or None when an instance of the model
            was ready as the request arrived (`model_ready`; no load: 0).
    """

    model: ModelId
    started_ns: int
    ready_times: ReadyTimes | None

    def duration_ns(self, first_chunk_ns: int) -> int:
        """Nanoseconds from the request's arrival until an instance of its model was
        ready (at most until its first chunk, `first_chunk_ns`); 0 when one was ready
        on arrival."""
        if self.ready_times is None:
            return 0
        ready = self.ready_times.first_ready_at_or_after(self.model, self.started_ns)
        end = first_chunk_ns if ready is None else min(ready, first_chunk_ns)
        return max(0, end - self.started_ns)
