"""The chat protocol shared by the API and the runner: rendering a conversation into a
model's prompt (`prompt`), and parsing what the model writes back into text, reasoning and
tool calls (`output_parsing`, `tool_call_parsing`, `tool_arguments`).

The API uses it to count a request's prompt tokens and the runner to build and read
generations; it sits on the floor above `shared` and imports nothing of the engine, the
API or the node (`docs/architecture.md`, "Floors").
"""
