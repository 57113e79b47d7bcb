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
