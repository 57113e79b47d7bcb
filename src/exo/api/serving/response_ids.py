"""Response ids that name their command, so any dialect's id can cancel its generation."""

from __future__ import annotations

import re
import uuid

from exo.shared.types.common import CommandId


def command_id_in_response_id(response_id: str) -> CommandId | None:
    """The command id inside a dialect's response id (`chatcmpl-<hex>`, `msg_<hex>`,
    `resp_<hex>`), or the id itself when it is already a command id; None when neither."""
    try:
        return CommandId(str(uuid.UUID(response_id)))
    except ValueError:
        pass
    match = re.fullmatch(r"[A-Za-z]+[-_]([0-9a-fA-F]{32})", response_id)
    if match is None:
        return None
    return CommandId(str(uuid.UUID(match.group(1))))


def response_id(prefix: str, command_id: CommandId) -> str:
    """A dialect's response id that names its command, e.g. `chatcmpl-` + 32 hex digits;
    `POST /v1/cancel/{id}` accepts it."""
    return f"{prefix}{uuid.UUID(command_id).hex}"
