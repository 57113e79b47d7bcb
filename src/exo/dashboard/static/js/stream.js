// One streamed Chat Completions request: fetch + ReadableStream over the SSE body,
// accumulating content, reasoning (`reasoning_content`), tool calls and usage, timing
// time to first token (TTFT) and decode speed, and following a long prompt's prefill
// (the node's `: prefill {...}` comment lines before the first token).

import { ApiError, apiFetch, errorMessage } from "./api.js";

/** Splits a `<think>…</think>` prefix out of content (models whose thinking the server did
 * not separate). An unclosed `<think>` is all thinking so far. */
export function splitThinking(content) {
  const match = /^\s*<think>([\s\S]*?)(<\/think>|$)([\s\S]*)$/.exec(content);
  if (!match) return { thinking: "", answer: content };
  return { thinking: match[1].trim(), answer: match[3].replace(/^\s+/, "") };
}

const PREFILL_COMMENT = "prefill ";

/** The prefill progress a comment line's text (after its `:`) reports, or null:
 * `{prompt, cached, done}` in tokens, from the node's
 * `: prefill {"prompt_tokens", "cached_tokens", "prefilled_tokens"}` lines. */
export function prefillProgress(comment) {
  const text = comment.replace(/^ /, "");
  if (!text.startsWith(PREFILL_COMMENT)) return null;
  try {
    const fields = JSON.parse(text.slice(PREFILL_COMMENT.length));
    const prompt = Number(fields.prompt_tokens);
    const done = Number(fields.prefilled_tokens);
    if (!Number.isFinite(prompt) || !Number.isFinite(done) || prompt <= 0) return null;
    return { prompt, cached: Number(fields.cached_tokens) || 0, done: Math.min(done, prompt) };
  } catch {
    return null;
  }
}

/** Yields each SSE event of a body as `{data}` (its `data:` lines joined) and each
 * comment line as `{comment}` (the text after its `:`). */
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const lines = block.split(/\r?\n/);
      for (const line of lines) {
        if (line.startsWith(":")) yield { comment: line.slice(1) };
      }
      const data = lines
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield { data };
    }
  }
}

/**
 * Sends `body` (stream forced on) and calls `onUpdate(result)` as chunks arrive.
 * result: {id, content, reasoning, toolCalls: [{id, name, arguments}], usage, finishReason,
 * ttftMs, tokensPerSecond, prefill}; `prefill` is the prompt's prefill progress
 * (`prefillProgress`) until the first token, then null. Throws on an HTTP error (the
 * message of the error body) and lets an AbortError through when `signal` aborts.
 */
export async function streamChat(body, { signal, onUpdate, onId }) {
  const started = performance.now();
  const response = await apiFetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", accept: "text/event-stream" },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw new ApiError(await errorMessage(response), response.status, null);
  const result = {
    id: null,
    content: "",
    reasoning: "",
    toolCalls: [],
    usage: null,
    finishReason: null,
    ttftMs: null,
    tokensPerSecond: null,
    prefill: null,
  };
  let firstAt = null;
  let lastAt = null;
  let pieces = 0;
  for await (const { data, comment } of sseEvents(response.body)) {
    if (comment !== undefined) {
      const progress = firstAt === null ? prefillProgress(comment) : null;
      if (progress) {
        result.prefill = progress;
        onUpdate?.(result);
      }
      continue;
    }
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
    if (!result.id && chunk.id) {
      result.id = chunk.id;
      onId?.(chunk.id);
    }
    if (chunk.usage) result.usage = chunk.usage;
    for (const choice of chunk.choices ?? []) {
      const delta = choice.delta ?? {};
      const text = (delta.content ?? "") + (delta.reasoning_content ?? "");
      if (delta.content) result.content += delta.content;
      if (delta.reasoning_content) result.reasoning += delta.reasoning_content;
      for (const call of delta.tool_calls ?? []) {
        const index = call.index ?? result.toolCalls.length;
        const slot = (result.toolCalls[index] ??= { id: "", name: "", arguments: "" });
        if (call.id) slot.id = call.id;
        if (call.function?.name) slot.name += call.function.name;
        if (call.function?.arguments) slot.arguments += call.function.arguments;
      }
      if (text || delta.tool_calls) {
        const now = performance.now();
        firstAt ??= now;
        lastAt = now;
        result.prefill = null;
        pieces += 1;
        result.ttftMs = firstAt - started;
      }
      if (choice.finish_reason) result.finishReason = choice.finish_reason;
    }
    onUpdate?.(result);
  }
  const tokens = result.usage?.completion_tokens ?? pieces;
  if (firstAt !== null && lastAt > firstAt && tokens > 1) {
    // Decode speed: the tokens after the first over the time they took.
    result.tokensPerSecond = ((tokens - 1) * 1000) / (lastAt - firstAt);
  } else if (firstAt !== null && tokens > 0 && lastAt > started) {
    // Every token arrived in one read (a proxy or a busy browser buffered the stream): the
    // rate over the whole request is all that can be measured.
    result.tokensPerSecond = (tokens * 1000) / (lastAt - started);
  }
  onUpdate?.(result);
  return result;
}
