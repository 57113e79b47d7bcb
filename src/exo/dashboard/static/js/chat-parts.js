// The pure parts of the chat: the request a conversation makes, and how one assistant
// message is shown (answer as safe Markdown, thinking and tool calls collapsed, stats).

import { renderMarkdown } from "./markdown.js";
import { splitThinking } from "./stream.js";
import { el } from "./ui.js";

/** The messages the API gets: the system prompt, then each turn's text (text attachments
 * appended to their message as fenced blocks; images as OpenAI `image_url` parts with
 * data: URLs after the text). */
export function apiMessages(conversation, upTo = conversation.messages.length) {
  const messages = [];
  if (conversation.system.trim()) messages.push({ role: "system", content: conversation.system });
  for (const message of conversation.messages.slice(0, upTo)) {
    if (message.role === "assistant" && message.error) continue;
    let content = message.content;
    const images = [];
    for (const file of message.attachments ?? []) {
      if (file.image) images.push({ type: "image_url", image_url: { url: file.image } });
      else content += `\n\n${file.name}:\n\`\`\`\n${file.text}\n\`\`\``;
    }
    if (images.length) content = [...(content ? [{ type: "text", text: content }] : []), ...images];
    messages.push({ role: message.role, content });
  }
  return messages;
}

export function samplingFields(settings) {
  const fields = {};
  for (const [name, parse] of [
    ["temperature", parseFloat],
    ["top_p", parseFloat],
    ["max_tokens", (v) => parseInt(v, 10)],
    ["seed", (v) => parseInt(v, 10)],
  ]) {
    const raw = String(settings[name] ?? "").trim();
    if (raw === "") continue;
    const value = parse(raw);
    if (Number.isNaN(value)) throw new Error(`${name} must be a number`);
    fields[name] = value;
  }
  return fields;
}

/** TTFT, tok/s, tokens and how the answer ended. */
export function statsLine(message) {
  const parts = [];
  if (message.stats?.ttftMs !== null && message.stats?.ttftMs !== undefined) {
    parts.push(`TTFT ${(message.stats.ttftMs / 1000).toFixed(2)} s`);
  }
  if (message.stats?.tokensPerSecond) parts.push(`${message.stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (message.stats?.completionTokens) parts.push(`${message.stats.completionTokens} tokens`);
  if (message.stopped) parts.push("stopped");
  else if (message.stats?.finishReason === "length") parts.push("cut at max tokens");
  return parts.join(" · ");
}

/** Fills `bubble` with an assistant message. */
export function fillAssistant(bubble, message) {
  const separated = splitThinking(message.content);
  const thinking = [message.reasoning, separated.thinking].filter(Boolean).join("\n");
  bubble.replaceChildren();
  if (thinking) {
    bubble.append(el("details", { class: "thinking" }, el("summary", { text: message.streaming && !separated.answer ? "Thinking…" : "Thinking" }), el("pre", { text: thinking })));
  }
  for (const call of message.toolCalls ?? []) {
    bubble.append(el("details", { class: "tool-call" }, el("summary", { text: `Tool call: ${call.name}` }), el("pre", { text: call.arguments })));
  }
  const answer = el("div", { class: "markdown answer" });
  renderMarkdown(answer, separated.answer);
  bubble.append(answer);
  if (message.error) bubble.append(el("div", { class: "error-text", role: "alert", text: message.error }));
  if (message.streaming && !message.content && !message.reasoning) {
    if (message.prefill) answer.replaceChildren(prefillView(message.prefill));
    else answer.textContent = "…";
  }
}

/** A long prompt's prefill while the first token is awaited: tokens done of the prompt's
 * (prefix-cached ones counted as done) and a bar. */
export function prefillView({ prompt, cached, done }) {
  const percent = Math.floor((100 * done) / prompt);
  const cachedText = cached ? `, ${cached.toLocaleString("en-US")} cached` : "";
  return el(
    "div",
    { class: "prefill-progress", role: "status" },
    el("span", { class: "prefill-text", text: `Reading the prompt: ${done.toLocaleString("en-US")} / ${prompt.toLocaleString("en-US")} tokens${cachedText} (${percent} %)` }),
    el("progress", { class: "prefill-bar", max: String(prompt), value: String(done), "aria-label": "Prompt prefill progress" }),
  );
}
