"""The one internal request type every API dialect converts into."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from exo.shared.types.common import FrozenModel, ModelId

Role = Literal["system", "user", "assistant", "tool"]

# OpenAI caps top_logprobs at 20; so do we (each one costs a sort over the vocabulary).
MAX_TOP_LOGPROBS = 20
# OpenAI's range for a logit bias: -100 bans a token in practice, 100 forces it.
MAX_LOGIT_BIAS = 100.0
# OpenAI accepts at most 300 biased tokens per request; so do we.
MAX_LOGIT_BIAS_TOKENS = 300


class ToolCall(FrozenModel):
    """A function call the model made: `arguments` is a JSON object as text (OpenAI's wire
    form), already coerced to the tool's parameter types where the schema says them. A
    forced call cut short by `max_tokens` (its generation finishes "length") carries the
    object's text only as far as it was generated (`exo.chat_protocol.cut_tool_call`)."""

    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = "{}"


class ToolDefinition(FrozenModel):
    """A function the model may call. `parameters` is a JSON Schema (an object schema;
    `{}` means no parameters)."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class NamedToolChoice(FrozenModel):
    """Force a call of this one tool."""

    name: str = Field(min_length=1)


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice
ResponseFormat = Literal["text", "json_object", "json_schema"]
ReasoningEffort = Literal["minimal", "low", "medium", "high"]
# A request's or a node's speculative decoding: on, off, or as measured per instance.
SpeculativeMode = bool | Literal["auto"]
# The draft length's bounds by default (tokens per request per step; `--draft-min`,
# `--draft-max`). llama-server's defaults for a draft model are 0 / 16; on a CPU a step's
# rows must also stay within the decode kernels' row bound (the scheduler's
# `max_decode_rows`, 7), which caps a lone stream's draft at 6 anyway.
DEFAULT_DRAFT_MIN = 1
DEFAULT_DRAFT_MAX = 6


IMAGE_MARKER = "<__exo_image__>"
"""Stands for one image in `ChatMessage.content`, at the image's place among the text: the
runner's prompt rendering turns each into the chat template's image part (and the model's
image tokens), in the order of `ChatMessage.images`."""


class ImageInput(FrozenModel):
    """One image of a request, decoded and checked by the API node (`exo.api.wire.images`).

    `data` is the image file's bytes as the client sent them (PNG, JPEG, WebP, GIF: its
    first frame is the image, BMP), base64 (URL-safe alphabet) in JSON; `media_type` is
    the format Pillow found in them (`image/png`, ...), not what the client declared;
    `width` and `height` are pixels; `sha256` is the hex digest of `data`, which the prefix
    cache keys on.
    """

    model_config = ConfigDict(
        frozen=True, strict=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64"
    )

    data: bytes = Field(min_length=1)
    media_type: str = Field(pattern=r"^image/[a-z0-9.+-]+$")
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    def __repr_args__(self) -> Any:
        # A log line names the image, never its (megabytes of) bytes.
        for name, value in super().__repr_args__():
            yield (name, f"<{len(value)} bytes>") if isinstance(value, bytes) else (name, value)


class ChatMessage(FrozenModel):
    """One turn of the conversation.

    `tool_calls` are an assistant turn's calls (replayed history); `tool_call_id` ties a
    `tool` turn's result to its call; `reasoning_content` is an assistant turn's thinking,
    passed to templates that render it. `images` are the turn's images (a user turn's, or
    a tool result's), in order: `content` holds one `IMAGE_MARKER` at each one's place.
    Only models with the "vision" capability get any (the API refuses them for others).
    """

    role: Role
    content: str = ""
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning_content: str | None = None
    images: tuple[ImageInput, ...] = ()


class TextGenerationTaskParams(FrozenModel):
    """A generation request, dialect-independent: a conversation (`messages`, rendered
    through the model's chat template) or a raw `prompt` (exactly one of the two).

    A raw `prompt` is tokenized as it is, with only the special tokens the tokenizer itself
    adds (a BOS token where the model has one), and the output is returned as generated:
    no chat template, no thinking section, no tool-call parsing. It is how base models
    (models without a chat template) are served: OpenAI's legacy completions and Ollama's
    `raw` generate. Tools and thinking switches need a conversation.

    `max_tokens=None` means "until the context is full or a stop condition"; sampling
    fields left as None take the model card's defaults. A `temperature` below 1e-5, 0
    included, is greedy (`SamplingParams.is_greedy`).
    `top_k == 0` and `top_p == 1` and `min_p == 0` disable those filters.

    Penalties (applied to the logits before sampling, over the tokens generated so far):
    `presence_penalty` and `frequency_penalty` as OpenAI defines them (subtract once per
    seen token / per occurrence), `repetition_penalty` as Keskar et al. 2019 (CTRL) and
    transformers apply it (divide positive logits, multiply negative ones; prompt tokens
    included). 0, 0 and None/1.0 disable them.

    `logit_bias` maps token ids to a number added to their logit at every step (after the
    penalties, before temperature and the filters; OpenAI's semantics): -100 bans a token
    in practice, 100 all but forces it. Ids must be below the model's vocabulary size
    (the engine refuses others).

    `tools` reach the chat template; `tool_choice` "none" hides them, "required" or a
    `NamedToolChoice` constrains decoding to one call. `response_format="json_object"`
    constrains decoding to one JSON object; "json_schema" to one JSON value that follows
    `json_schema` (a JSON Schema, as far as `json_schema_grammar` enforces it), which is
    set exactly when the format is "json_schema". `logprobs` asks for the sampled tokens'
    log probabilities, `top_logprobs` for that many alternatives per position.
    `enable_thinking` / `reasoning_effort` are passed to chat templates that read them
    (None: the template's default).
    """

    model: ModelId
    messages: tuple[ChatMessage, ...] = ()
    prompt: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    context_tokens: int | None = Field(default=None, ge=1)
    """The most tokens, prompt and reply together, the request may hold (Ollama's
    `options.num_ctx`), below the model's context and KV budget; None: those alone."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: tuple[str, ...] = ()
    stream: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    repetition_window: int | None = Field(default=None, ge=1)
    """The repetition penalty's window: the last this many tokens of prompt and reply
    (Ollama's and llama.cpp's `repeat_last_n`); None: the whole prompt and reply."""
    tools: tuple[ToolDefinition, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    response_format: ResponseFormat = "text"
    json_schema: dict[str, Any] | None = None
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS_TOKENS)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    enable_thinking: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    speculative: SpeculativeMode | None = None
    """Speculative decoding for this request (exo's extension, the same name in every
    dialect): True verifies draft tokens wherever a draft is found, False never, "auto"
    as the instance measures it to help; None: the node's `--speculative`. The output is
    the same either way (greedy: token for token; sampled: the same distribution, and the
    same tokens for one seed)."""
    forced_token_ids: tuple[int, ...] = ()
    """Tokens this request already generated and streamed elsewhere (mid-stream failover,
    `exo.api.serving.failover`): the engine prefills them after the prompt as its own
    output — the stop matcher, parsers, penalties, grammar and seeded sampler advanced over
    them, nothing streamed for them — and decodes on from there. They count among the
    completion tokens and `max_tokens`. Set by the API node only; no dialect exposes it."""

    @field_validator("forced_token_ids")
    @classmethod
    def _check_forced_token_ids(cls, token_ids: tuple[int, ...]) -> tuple[int, ...]:
        if any(token_id < 0 for token_id in token_ids):
            raise ValueError("forced token ids start at 0")
        return token_ids

    @model_validator(mode="after")
    def _check_input(self) -> TextGenerationTaskParams:
        if (self.prompt is None) == (not self.messages):
            raise ValueError(
                "a request has either messages (a conversation) or a raw prompt, "
                "exactly one of the two"
            )
        if self.prompt is not None:
            needs_conversation = {
                "tools": bool(self.tools),
                "tool_choice": self.tool_choice not in ("auto", "none"),
                "enable_thinking": self.enable_thinking is not None,
                "reasoning_effort": self.reasoning_effort is not None,
            }
            for name, given in needs_conversation.items():
                if given:
                    raise ValueError(
                        f"{name} needs a conversation (messages): a raw prompt reaches the "
                        "model without a chat template"
                    )
        return self

    @model_validator(mode="after")
    def _check_tool_choice(self) -> TextGenerationTaskParams:
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs at least one tool")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.name for tool in self.tools}
            if self.tool_choice.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.name!r}, which is not among the "
                    f"tools ({', '.join(sorted(names)) or 'none given'})"
                )
        if self.response_format != "text" and self.forces_tool_call:
            format_name = self.response_format
            raise ValueError(
                f"response_format {format_name} cannot be combined with a forced tool call"
            )
        if (self.response_format == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is set exactly when response_format is 'json_schema'")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[int, float]) -> dict[int, float]:
        for token_id, value in bias.items():
            if token_id < 0:
                raise ValueError(f"token id {token_id} is negative; token ids start at 0")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"the bias of token {token_id} is {value}; biases lie in "
                    f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
        return bias

    @property
    def is_raw(self) -> bool:
        """True for a raw prompt (used without the chat template)."""
        return self.prompt is not None

    @property
    def forces_tool_call(self) -> bool:
        """True when decoding must produce a tool call ("required" or a named tool)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def offered_tools(self) -> tuple[ToolDefinition, ...]:
        """The tools the template sees: none when `tool_choice` is "none"; only the named
        one when a tool is named."""
        if self.tool_choice == "none":
            return ()
        if isinstance(self.tool_choice, NamedToolChoice):
            return tuple(tool for tool in self.tools if tool.name == self.tool_choice.name)
        return self.tools
