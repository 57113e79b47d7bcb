"""Runner statuses, as reported by a runner's supervisor."""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

from pydantic import Field

from exo.shared.models.kv_cache_memory import DEFAULT_KV_CACHE_TOKENS
from exo.shared.types.common import FrozenModel


class RunnerIdle(FrozenModel):
    """Process started, nothing loaded."""

    kind: Literal["RunnerIdle"] = "RunnerIdle"


class RunnerConnecting(FrozenModel):
    """Joining the instance's process group (waits for every rank)."""

    kind: Literal["RunnerConnecting"] = "RunnerConnecting"


class RunnerConnected(FrozenModel):
    kind: Literal["RunnerConnected"] = "RunnerConnected"


class RunnerLoading(FrozenModel):
    kind: Literal["RunnerLoading"] = "RunnerLoading"
    layers_loaded: int = Field(ge=0)
    total_layers: int = Field(ge=0)


class RunnerLoaded(FrozenModel):
    kind: Literal["RunnerLoaded"] = "RunnerLoaded"


class RunnerWarmingUp(FrozenModel):
    kind: Literal["RunnerWarmingUp"] = "RunnerWarmingUp"


class SpeculationStats(FrozenModel):
    """What speculative decoding did on a runner since it loaded (cumulative counts).

    `decode_rounds`: (request, step) pairs in which a decoding request took part, with or
    without a draft; `decode_tokens`: the tokens they emitted; `verify_rounds`: those that
    verified a draft; `drafted_tokens` / `accepted_tokens`: draft tokens verified and
    accepted. `acceptance_rate` is accepted over drafted (None before any draft),
    `tokens_per_step` decode tokens over decode rounds (1 without speculation; None before
    any); `auto_enabled` whether the instance's automatic switch drafts for "auto" requests
    now; `draft_connected` whether the draft model on another node (`Instance.draft.runner`)
    is linked now (False: its node or runner is lost and decoding goes on without drafts
    while rank 0 reconnects; checked every `DRAFT_LINK_CHECK_S` while idle), None where
    drafts come from rank 0's own process."""

    decode_rounds: int = Field(ge=0)
    decode_tokens: int = Field(ge=0)
    verify_rounds: int = Field(ge=0)
    drafted_tokens: int = Field(ge=0)
    accepted_tokens: int = Field(ge=0)
    acceptance_rate: float | None = None
    tokens_per_step: float | None = None
    auto_enabled: bool = True
    draft_connected: bool | None = None


class RunnerReady(FrozenModel):
    """Loaded and warmed up, waiting for a generation task. `weight_bytes` is what this
    rank's loaded parameters take (its share of the model); `max_concurrent_requests` how
    many generations its engine runs at once in its batch (`--max-concurrent-requests`;
    the API admits that many per instance plus a bounded queue); `kv_cache_tokens` its
    engine's KV-cache budget in tokens (its instance's, `Instance.kv_cache_tokens`);
    `card_mismatches` every fact of the model's card that its loaded files state otherwise
    (`exo.shared.models.profile.card_mismatches`), empty when they agree; `speculation`
    what speculative decoding did on it (None before a request ran, and on ranks other
    than 0 of a split instance: rank 0 drafts and counts for the whole instance, which
    verifies its drafts on every rank in one step); `draft_model` the draft model it
    loaded and drafts with (`Instance.draft`: its id, or the node's `--draft-model`
    directory), None: n-gram drafts; `draft_left_out` why the instance's draft model is
    not loaded though placement chose it (another vocabulary than the model's, its files
    missing, a bad config: the model serves without it, drafting by prompt lookup), None
    when it is or none was named."""

    kind: Literal["RunnerReady"] = "RunnerReady"
    weight_bytes: int = Field(default=0, ge=0)
    max_concurrent_requests: int = Field(default=1, ge=1)
    kv_cache_tokens: int = Field(default=DEFAULT_KV_CACHE_TOKENS, ge=0)
    card_mismatches: tuple[str, ...] = ()
    speculation: SpeculationStats | None = None
    draft_model: str | None = None
    draft_left_out: str | None = None


class RunnerRunning(FrozenModel):
    """Generating for at least one task. `weight_bytes`, `max_concurrent_requests`,
    `kv_cache_tokens`, `card_mismatches`, `speculation`, `draft_model` and `draft_left_out`
    as in `RunnerReady` (`speculation` updated at most every `SPECULATION_REPORT_INTERVAL_S`
    while it runs)."""

    kind: Literal["RunnerRunning"] = "RunnerRunning"
    weight_bytes: int = Field(default=0, ge=0, exclude_if=lambda weight_bytes: weight_bytes == 0)
    """Left out of the JSON when 0, so the records of older versions keep their bytes."""
    max_concurrent_requests: int = Field(default=1, ge=1)
    kv_cache_tokens: int = Field(default=DEFAULT_KV_CACHE_TOKENS, ge=0)
    card_mismatches: tuple[str, ...] = ()
    speculation: SpeculationStats | None = None
    draft_model: str | None = None
    draft_left_out: str | None = None


class RunnerFailed(FrozenModel):
    """The runner stopped serving: its process died, its group broke, or loading or
    warming up its model raised."""

    kind: Literal["RunnerFailed"] = "RunnerFailed"
    error_message: str
    permanent: bool = Field(default=False, exclude_if=lambda permanent: not permanent)
    """Loading or warming up the model raised an error of the model itself (a tensor of
    the wrong shape, a config the engine refuses: `failures.load_failure_is_permanent`),
    so loading it again the same way fails again; an instance deleted after such failures
    is a final error for its requests (`LoadFailure`). Left out of the JSON when False,
    so the records of older versions keep their bytes (and `event_digest`)."""


class RunnerShutdown(FrozenModel):
    kind: Literal["RunnerShutdown"] = "RunnerShutdown"


RunnerStatus = Annotated[
    RunnerIdle
    | RunnerConnecting
    | RunnerConnected
    | RunnerLoading
    | RunnerLoaded
    | RunnerWarmingUp
    | RunnerReady
    | RunnerRunning
    | RunnerFailed
    | RunnerShutdown,
    Field(discriminator="kind"),
]


class KVCacheUse(NamedTuple):
    """One local runner's KV cache as it last reported it, in tokens (node-local: for the
    node's `/metrics`, never a cluster event)."""

    runner_id: str
    model_id: str
    running_tokens: int
    prefix_cache_tokens: int
    budget_tokens: int
