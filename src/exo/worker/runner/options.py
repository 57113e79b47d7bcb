"""How this node's runners run: the node options that reach each runner and its engine,
handed from the node (`main.py`) to the worker, each runner's supervisor and the
runner process as one value."""

from __future__ import annotations

from pydantic import Field, model_validator

from exo.shared.models.kv_cache_memory import KVCacheDtype
from exo.shared.models.weight_formats import (
    DEFAULT_DECODE_ACTIVATIONS,
    DEFAULT_PREFILL_ACTIVATIONS,
    DecodeActivations,
    PrefillActivations,
)
from exo.shared.types.common import FrozenModel
from exo.shared.types.text_generation import (
    DEFAULT_DRAFT_MAX,
    DEFAULT_DRAFT_MIN,
    SpeculativeMode,
)


class RunnerOptions(FrozenModel):
    """Attributes:
    max_concurrent_requests: requests a runner's engine batches together
        (`--max-concurrent-requests`; None: the engine's default).
    stream_interval_seconds: how long a runner holds a stream's tokens to send them
        together (`--stream-interval-ms`).
    prefill_activations: how prefill rounds quantized weights' activations
        (`--prefill-activations`).
    decode_activations: how int4 weights' products round activations
        (`--decode-activations`; int8 covers a prompt's rows too).
    kv_cache_tokens: the KV-cache budget of the runner's engine in tokens, running
        requests and the prefix cache together: its instance's (`Instance.kv_cache_tokens`,
        chosen by placement) bounded by the node's `--kv-cache-tokens`, else the node's
        option; None: `DEFAULT_KV_CACHE_TOKENS`. Counted in the default KV dtype's bytes
        (placement's); a float32 runner holds `kv_cache_tokens_for_dtype` of them.
    kv_cache_dtype: how the runner's engine stores keys and values on CPU
        (`--kv-cache-dtype`; None: `kv_memory.kv_cache_torch_dtype`'s default).
    speculative: speculative decoding for requests that do not say (`--speculative`).
    draft_min / draft_max: the draft length's bounds in tokens (`--draft-min`,
        `--draft-max`; `speculative_policy.SpeculationSettings`).
    draft_model: the draft model of speculative decoding (`--draft-model`: a model id or
        local directory already on this node; None: n-gram drafts).
    rank_group_key: hex of the key split instances' ranks authenticate each other with
        (`ClusterSecret.rank_group_key`); None without a cluster secret. Kept out of reprs.
    draft_server_port: set for the draft runner of an instance whose draft model runs on a
        spare node (`InstanceDraft.runner`): it loads the draft model and serves drafts on
        this port instead of serving generations.
    remote_draft_host / remote_draft_port: set for rank 0 of such an instance: where it asks
        the draft runner for drafts (the address its node reaches the spare node on).
    """

    max_concurrent_requests: int | None = Field(default=None, ge=1)
    stream_interval_seconds: float = Field(default=0.0, ge=0)
    prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS
    decode_activations: DecodeActivations = DEFAULT_DECODE_ACTIVATIONS
    kv_cache_tokens: int | None = Field(default=None, ge=1)
    kv_cache_dtype: KVCacheDtype | None = None
    speculative: SpeculativeMode = "auto"
    draft_min: int = Field(default=DEFAULT_DRAFT_MIN, ge=1)
    draft_max: int = Field(default=DEFAULT_DRAFT_MAX, ge=1)
    draft_model: str | None = None
    rank_group_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$", repr=False)
    draft_server_port: int | None = Field(default=None, gt=0, lt=65536)
    remote_draft_host: str | None = None
    remote_draft_port: int | None = Field(default=None, gt=0, lt=65536)

    @model_validator(mode="after")
    def _check_draft_bounds(self) -> RunnerOptions:
        if self.draft_min > self.draft_max:
            raise ValueError(f"draft_min {self.draft_min} is above draft_max {self.draft_max}")
        return self
