"""Checks on a converted conversation that every chat dialect makes alike."""

from __future__ import annotations

from collections.abc import Sequence

from exo.api.wire.errors import InvalidRequestError
from exo.shared.types.text_generation import ChatMessage


def check_tool_results_answer_calls(messages: Sequence[ChatMessage], param: str) -> None:
    """Every tool result must answer a call an earlier assistant turn made (OpenAI and
    Anthropic refuse an orphan result with a 400 too).

    Raises:
        InvalidRequestError: naming the unanswered id, blaming `param`.
    """
    called: set[str] = set()
    for message in messages:
        if message.role == "assistant":
            called.update(call.id for call in message.tool_calls)
        elif (
            message.role == "tool"
            and message.tool_call_id is not None
            and message.tool_call_id not in called
        ):
            raise InvalidRequestError(
                f"a tool result answers the call {message.tool_call_id!r}, but no earlier "
                "assistant turn made a call with that id",
                param,
            )


def unanswered_tool_calls(
    messages: Sequence[ChatMessage], *, directly_after: bool
) -> list[tuple[int, tuple[str, ...]]]:
    """The assistant turns whose tool calls are left without a result.

    A final assistant turn is exempt: it is a continuation (the model goes on from it), so
    its calls have no results yet by design.

    Args:
        directly_after: True (Chat Completions): a call's result must be among the `tool`
            messages right after its turn; False (Responses): anywhere after it.

    Returns:
        `(index of the assistant message in messages, ids of its unanswered calls)` for
        each such turn, in order.
    """
    found: list[tuple[int, tuple[str, ...]]] = []
    for index, message in enumerate(messages[:-1]):
        if message.role != "assistant" or not message.tool_calls:
            continue
        answered: set[str] = set()
        for later in messages[index + 1 :]:
            if later.role == "tool" and later.tool_call_id is not None:
                answered.add(later.tool_call_id)
            elif directly_after:
                break
        missing = tuple(call.id for call in message.tool_calls if call.id not in answered)
        if missing:
            found.append((index, missing))
    return found
