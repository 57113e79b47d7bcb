"""A runner's speculative-decoding counts reach the cluster state in its status: with the
first running status, at most every `SPECULATION_REPORT_INTERVAL_S` while it runs, and at
once in the ready status when its batch empties."""

from __future__ import annotations

import threading
import time

import pytest

from exo.shared.types.runners import RunnerReady, RunnerRunning, SpeculationStats
from exo.testing.builders import make_text_generation_task
from exo.worker.engines.torch.decoding.speculative_policy import SpeculationCounters
from exo.worker.runner import runner as runner_module
from exo.worker.runner.messages import RunnerOutbound, RunnerStatusReport, decode_outbound
from exo.worker.tests.test_runner_batching import BatchEngine, ready_runner


class SpeculatingEngine(BatchEngine):
    """`BatchEngine` whose every step verified a draft of 3, of which 2 were accepted."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.counters = SpeculationCounters()

    def step(self) -> list[tuple[str, object]]:  # type: ignore[override]
        outputs = super().step()
        for _ in outputs:
            self.counters.decode_rounds += 1
            self.counters.decode_tokens += 3
            self.counters.verify_rounds += 1
            self.counters.drafted_tokens += 3
            self.counters.accepted_tokens += 2
        return list(outputs)

    def speculation_counters(self) -> tuple[SpeculationCounters, bool]:
        return SpeculationCounters(**{
            name: getattr(self.counters, name)
            for name in ("decode_rounds", "decode_tokens", "verify_rounds", "drafted_tokens",
                         "accepted_tokens")
        }), True  # fmt: skip


def statuses(sent: list[RunnerOutbound]) -> list[object]:
    return [message.status for message in sent if isinstance(message, RunnerStatusReport)]


def run_to_end(engine: SpeculatingEngine) -> list[object]:
    """One request through a ready runner: the statuses it reported, in order."""
    runner, _inbound_writer, outbound_reader = ready_runner(engine)
    sent: list[RunnerOutbound] = []
    runner._start_generation(make_text_generation_task(task_id="task-a"))
    for _step in range(8):
        if runner._generations:
            runner._run_step()
    while outbound_reader.poll(0):
        sent.extend(decode_outbound(outbound_reader.recv_bytes()))
    reported = statuses(sent)
    assert reported[-1] == runner._ready
    return reported


FINAL = SpeculationStats(
    decode_rounds=6, decode_tokens=18, verify_rounds=6, drafted_tokens=18, accepted_tokens=12,
    acceptance_rate=12 / 18, tokens_per_step=3.0, auto_enabled=True,
)  # fmt: skip


def test_speculation_counts_reach_the_ready_status_when_the_batch_empties() -> None:
    reported = run_to_end(SpeculatingEngine(length=6))
    # Running (before any step: nothing measured yet), then ready with every step's counts;
    # no running status in between (the steps took far less than the interval).
    assert [type(status) for status in reported] == [RunnerRunning, RunnerReady]
    first, final = reported
    assert isinstance(first, RunnerRunning) and first.speculation is not None
    assert first.speculation.decode_rounds == 0 and first.speculation.acceptance_rate is None
    assert isinstance(final, RunnerReady) and final.speculation == FINAL


def test_speculation_counts_are_reported_while_running_once_the_interval_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner_module, "SPECULATION_REPORT_INTERVAL_S", 0.0)
    reported = run_to_end(SpeculatingEngine(length=6))
    running = [status for status in reported if isinstance(status, RunnerRunning)]
    rounds = [status.speculation.decode_rounds for status in running if status.speculation]
    assert rounds == [0, 1, 2, 3, 4, 5]  # after each step but the last (then: ready)
    final = reported[-1]
    assert isinstance(final, RunnerReady) and final.speculation == FINAL


class RemoteDraftingEngine(SpeculatingEngine):
    """Drafts over a link to another node, whose state the test sets."""

    draft_connected: bool | None = True


def test_a_lost_draft_link_shows_in_the_ready_status_while_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, an idle runner blocked on its pipe: a draft node lost between requests left
    # the state saying nothing until the next request ran.
    monkeypatch.setattr(runner_module, "DRAFT_LINK_CHECK_S", 0.01)
    engine = RemoteDraftingEngine(length=2)
    runner, inbound_writer, outbound_reader = ready_runner(engine)
    runner._start_generation(make_text_generation_task(task_id="task-a"))
    while runner._generations:
        runner._run_step()
    assert runner._ready.speculation is not None
    assert runner._ready.speculation.draft_connected is True
    engine.draft_connected = False
    waiter = threading.Thread(target=runner._wait_for_a_message)
    waiter.start()
    sent: list[RunnerOutbound] = []
    deadline = time.monotonic() + 10
    lost = None
    while lost is None and time.monotonic() < deadline:
        if outbound_reader.poll(0.05):
            sent.extend(decode_outbound(outbound_reader.recv_bytes()))
        lost = next(
            (s for s in statuses(sent) if isinstance(s, RunnerReady) and s.speculation
             and s.speculation.draft_connected is False),
            None,
        )  # fmt: skip
    inbound_writer.send_bytes(b"{}")  # a message: the wait ends
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert lost is not None, statuses(sent)
    assert lost.speculation is not None and lost.speculation.decode_rounds == 2
