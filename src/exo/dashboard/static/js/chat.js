// Chat view: conversations (localStorage), a model picker over the served models, system
// prompt and sampling settings, streamed answers rendered as safe Markdown, thinking and
// tool calls collapsed, stop / regenerate / edit, text attachments, images for models with
// vision (sent as data: URLs in image_url parts), TTFT and tok/s.

import { apiFetch, apiJson } from "./api.js";
import { loadConversations, newConversation, saveConversations, titleFrom } from "./conversations.js";
import { instanceStatus } from "./runners.js";
import { store, subscribe } from "./store.js";
import { el, replace, toast } from "./ui.js";
import { streamChat } from "./stream.js";
import { apiMessages, fillAssistant, samplingFields, statsLine } from "./chat-parts.js";

const MAX_ATTACHMENT_BYTES = 256 * 1024;
// Images are kept with the conversation in localStorage (about 5 MB per origin).
const MAX_IMAGE_BYTES = 3 * 1024 * 1024;
const ACTIVE_KEY = "exo.activeConversation";

export function mountChat(section) {
  const root = section.querySelector("#chat-root");
  let conversations = loadConversations();
  let active = conversations.find((c) => c.id === localStorage.getItem(ACTIVE_KEY)) ?? null;
  let running = null; // {controller, id, conversationId}
  let attachments = [];

  const list = el("ul", { "aria-label": "Conversations" });
  const sidebar = el(
    "aside",
    { class: "chat-sidebar" },
    el("button", { type: "button", class: "primary", id: "new-chat", text: "New chat", onclick: () => startNew() }),
    el("button", {
      type: "button",
      class: "phone-only",
      text: "Conversations",
      "aria-expanded": "false",
      onclick: (event) => {
        const open = sidebar.classList.toggle("open");
        event.target.setAttribute("aria-expanded", String(open));
      },
    }),
    list,
  );
  const modelSelect = el("select", { id: "chat-model", "aria-label": "Model" });
  const systemInput = el("textarea", { id: "chat-system", rows: 2, placeholder: "You are a helpful assistant." });
  const settingInputs = {
    temperature: el("input", { id: "chat-temperature", type: "number", step: "0.1", min: "0", max: "2", placeholder: "model default" }),
    top_p: el("input", { id: "chat-top-p", type: "number", step: "0.05", min: "0", max: "1", placeholder: "model default" }),
    max_tokens: el("input", { id: "chat-max-tokens", type: "number", step: "1", min: "1", placeholder: "no limit" }),
    seed: el("input", { id: "chat-seed", type: "number", step: "1", placeholder: "random" }),
  };
  const settings = el(
    "details",
    { class: "chat-settings" },
    el("summary", { text: "System prompt and sampling" }),
    el(
      "div",
      { class: "settings-grid" },
      el("label", { class: "wide" }, "System prompt", systemInput),
      el("label", {}, "Temperature", settingInputs.temperature),
      el("label", {}, "Top p", settingInputs.top_p),
      el("label", {}, "Max tokens", settingInputs.max_tokens),
      el("label", {}, "Seed", settingInputs.seed),
    ),
  );
  const messagesBox = el("div", { class: "messages", id: "messages", "aria-live": "polite" });
  const input = el("textarea", {
    id: "chat-input",
    rows: 2,
    placeholder: "Ask something…",
    "aria-label": "Message",
  });
  const fileInput = el("input", { type: "file", id: "chat-attach", multiple: true, hidden: true, accept: "text/*,.md,.py,.js,.ts,.json,.toml,.yaml,.yml,.csv,.log,.rs,.go,.c,.h,.cpp,.java,.sh" });
  const attachButton = el("button", { type: "button", id: "attach-button", text: "Attach", "aria-label": "Attach text files", onclick: () => fileInput.click() });
  const imageInput = el("input", { type: "file", id: "chat-attach-image", multiple: true, hidden: true, accept: "image/png,image/jpeg,image/webp,image/gif" });
  const imageButton = el("button", { type: "button", id: "image-button", text: "Image", "aria-label": "Attach images", hidden: true, onclick: () => imageInput.click() });
  const sendButton = el("button", { type: "button", class: "primary", id: "send-button", text: "Send", onclick: () => send() });
  const stopButton = el("button", { type: "button", class: "danger", id: "stop-button", text: "Stop", hidden: true, onclick: () => stop() });
  const attachmentList = el("div", { class: "attachments", id: "attachments" });
  const composer = el(
    "div",
    { class: "composer" },
    attachmentList,
    el("div", { class: "composer-row" }, attachButton, imageButton, input, sendButton, stopButton),
    el("div", { class: "hint hide-phone", text: "Enter sends · Shift+Enter new line · Esc stops · Attach adds text files" }),
    fileInput,
    imageInput,
  );
  root.append(
    sidebar,
    el("div", { class: "chat-main" }, el("div", { class: "chat-head" }, el("label", { for: "chat-model", class: "hide-phone", text: "Model" }), modelSelect), settings, messagesBox, composer),
  );

  function persist() {
    if (!active) return;
    active.updatedAt = Date.now();
    conversations = [active, ...conversations.filter((c) => c.id !== active.id)];
    saveConversations(conversations);
    localStorage.setItem(ACTIVE_KEY, active.id);
    renderList();
  }

  function startNew() {
    if (running) return;
    active = null;
    attachments = [];
    renderAttachments();
    renderMessages();
    renderList();
    input.focus();
  }

  function ensureActive() {
    if (!active) {
      active = newConversation(modelSelect.value);
      readSettings();
    }
    return active;
  }

  function readSettings() {
    if (!active) return;
    active.system = systemInput.value;
    for (const [name, field] of Object.entries(settingInputs)) active.settings[name] = field.value;
  }

  function writeSettings() {
    systemInput.value = active?.system ?? "";
    for (const [name, field] of Object.entries(settingInputs)) field.value = active?.settings[name] ?? "";
  }

  for (const field of [systemInput, ...Object.values(settingInputs)]) {
    field.addEventListener("change", () => {
      if (active) {
        readSettings();
        persist();
      }
    });
  }
  modelSelect.addEventListener("change", () => {
    showImageButton();
    if (active) {
      active.model = modelSelect.value;
      persist();
    }
  });

  function renderList() {
    replace(
      list,
      conversations.map((c) =>
        el(
          "li",
          {},
          el("button", {
            type: "button",
            class: "conv",
            text: c.title,
            title: c.title,
            "aria-current": String(c.id === active?.id),
            onclick: () => {
              if (running) return;
              active = c;
              localStorage.setItem(ACTIVE_KEY, c.id);
              if (c.model) selectModel(c.model);
              writeSettings();
              renderMessages();
              renderList();
            },
          }),
          el("button", {
            type: "button",
            class: "conv-delete",
            text: "✕",
            "aria-label": `Delete conversation ${c.title}`,
            onclick: () => {
              if (running?.conversationId === c.id) return;
              conversations = conversations.filter((x) => x.id !== c.id);
              saveConversations(conversations);
              if (active?.id === c.id) startNew();
              renderList();
            },
          }),
        ),
      ),
    );
  }

  function messageView(message, index) {
    const bubble = el("div", { class: "bubble" });
    const node = el("div", { class: `message ${message.role}`, "data-index": String(index) }, el("div", { class: "role", text: message.role === "user" ? "You" : message.model || "Assistant" }), bubble);
    if (message.role === "user") {
      bubble.append(el("div", { class: "user-text", text: message.content }));
      if (message.attachments?.length) {
        bubble.append(
          el(
            "div",
            { class: "attachments" },
            message.attachments.map((f) => (f.image ? el("img", { class: "attachment-image", src: f.image, alt: f.name, title: f.name }) : el("span", { class: "attachment", text: `📄 ${f.name}` }))),
          ),
        );
      }
      node.append(el("div", { class: "meta" }, el("button", { type: "button", class: "edit-button", text: "Edit", onclick: () => editMessage(node, index) })));
      return node;
    }
    fillAssistant(bubble, message);
    const meta = el("div", { class: "meta" }, el("span", { class: "stats", text: statsLine(message) }));
    if (index === active.messages.length - 1 && !message.streaming) {
      meta.append(el("button", { type: "button", class: "regenerate-button", text: "Regenerate", onclick: () => regenerate() }));
    }
    node.append(meta);
    return node;
  }

  function renderMessages() {
    replace(messagesBox, active ? active.messages.map(messageView) : el("p", { class: "muted", text: "Pick a served model and ask something." }));
    messagesBox.scrollTop = messagesBox.scrollHeight;
  }

  function editMessage(node, index) {
    if (running) return;
    const message = active.messages[index];
    const box = el("textarea", { class: "edit-box", "aria-label": "Edit message" });
    box.value = message.content;
    const save = el("button", {
      type: "button",
      class: "primary",
      text: "Save and send",
      onclick: () => {
        message.content = box.value;
        active.messages = active.messages.slice(0, index + 1);
        persist();
        renderMessages();
        generate();
      },
    });
    const cancel = el("button", { type: "button", text: "Cancel", onclick: () => renderMessages() });
    box.addEventListener("keydown", (event) => {
      if (event.key === "Escape") renderMessages();
    });
    node.querySelector(".bubble").replaceChildren(box, el("div", { class: "row-actions" }, save, cancel));
    box.focus();
  }

  function regenerate() {
    if (running || !active) return;
    if (active.messages.at(-1)?.role === "assistant") active.messages.pop();
    persist();
    renderMessages();
    generate();
  }

  function setRunning(value) {
    running = value;
    stopButton.hidden = !value;
    sendButton.hidden = Boolean(value);
    messagesBox.setAttribute("aria-busy", String(Boolean(value)));
  }

  async function send() {
    if (running) return;
    const text = input.value;
    if (!text.trim() && !attachments.length) return;
    if (!modelSelect.value) {
      toast("No model is served yet: launch one first", "error");
      return;
    }
    const conversation = ensureActive();
    conversation.model = modelSelect.value;
    readSettings();
    if (!conversation.messages.length) conversation.title = titleFrom(text || attachments[0].name);
    conversation.messages.push({ role: "user", content: text, attachments });
    input.value = "";
    attachments = [];
    renderAttachments();
    persist();
    renderMessages();
    await generate();
  }

  // A request the node refused as invalid (400: an undecodable image, an image for a
  // model without vision, ...) was never answered: its user turn goes back into the
  // composer, text and attachments, instead of staying in the history where every later
  // request would repeat it.
  function unsend(conversation, message) {
    const at = conversation.messages.indexOf(message);
    const turn = conversation.messages[at - 1];
    if (at !== conversation.messages.length - 1 || turn?.role !== "user") return false;
    conversation.messages.splice(at - 1, 2);
    input.value = turn.content;
    attachments = turn.attachments ?? [];
    renderAttachments();
    return true;
  }

  async function generate() {
    const conversation = active;
    let body;
    try {
      body = { model: modelSelect.value || conversation.model, messages: apiMessages(conversation), ...samplingFields(conversation.settings) };
    } catch (error) {
      toast(error.message, "error");
      return;
    }
    const message = { role: "assistant", content: "", reasoning: "", toolCalls: [], model: body.model, streaming: true, stats: null };
    conversation.messages.push(message);
    renderMessages();
    const node = messagesBox.lastElementChild;
    const bubble = node.querySelector(".bubble");
    const stats = node.querySelector(".stats");
    const controller = new AbortController();
    setRunning({ controller, id: null, conversationId: conversation.id });
    let frame = 0;
    const update = (result) => {
      Object.assign(message, { content: result.content, reasoning: result.reasoning, toolCalls: result.toolCalls, prefill: result.prefill });
      message.stats = { ttftMs: result.ttftMs, tokensPerSecond: result.tokensPerSecond, completionTokens: result.usage?.completion_tokens, finishReason: result.finishReason };
      if (frame) return;
      frame = requestAnimationFrame(() => {
        frame = 0;
        const nearBottom = messagesBox.scrollHeight - messagesBox.scrollTop - messagesBox.clientHeight < 80;
        fillAssistant(bubble, message);
        stats.textContent = statsLine(message);
        if (nearBottom) messagesBox.scrollTop = messagesBox.scrollHeight;
      });
    };
    try {
      await streamChat(body, {
        signal: controller.signal,
        onUpdate: update,
        onId: (id) => {
          if (running) running.id = id;
        },
      });
    } catch (error) {
      if (error.name === "AbortError") message.stopped = true;
      else if (error.status === 400 && unsend(conversation, message)) toast(error.message, "error");
      else message.error = error.message;
    } finally {
      cancelAnimationFrame(frame);
      message.streaming = false;
      delete message.prefill;
      setRunning(null);
      if (active?.id === conversation.id) renderMessages();
      persist();
      input.focus();
    }
  }

  async function stop() {
    if (!running) return;
    const { controller, id } = running;
    stopButton.disabled = true;
    try {
      if (id) {
        // Cancel on every rank first, then leave (the node also cancels on disconnect).
        const timeout = AbortSignal.timeout(2000);
        await apiFetch(`/v1/cancel/${encodeURIComponent(id)}`, { method: "POST", signal: timeout }).catch(() => null);
      }
    } finally {
      controller.abort();
      stopButton.disabled = false;
    }
  }

  function renderAttachments() {
    replace(
      attachmentList,
      attachments.map((file, i) =>
        el(
          "span",
          { class: "attachment" },
          `${file.image ? "🖼" : "📄"} ${file.name} `,
          el("button", {
            type: "button",
            class: "conv-delete",
            text: "✕",
            "aria-label": `Remove ${file.name}`,
            onclick: () => {
              attachments.splice(i, 1);
              renderAttachments();
            },
          }),
        ),
      ),
    );
  }

  fileInput.addEventListener("change", async () => {
    for (const file of fileInput.files) {
      if (file.size > MAX_ATTACHMENT_BYTES) {
        toast(`${file.name} is larger than ${MAX_ATTACHMENT_BYTES / 1024} KB`, "error");
        continue;
      }
      const text = await file.text();
      if (text.includes("\u0000")) {
        toast(`${file.name} is not a text file`, "error");
        continue;
      }
      attachments.push({ name: file.name, text });
    }
    fileInput.value = "";
    renderAttachments();
  });

  imageInput.addEventListener("change", async () => {
    for (const file of imageInput.files) {
      if (file.size > MAX_IMAGE_BYTES) {
        toast(`${file.name} is larger than ${MAX_IMAGE_BYTES / 1024 / 1024} MB`, "error");
        continue;
      }
      attachments.push({ name: file.name, image: await dataUrl(file) });
    }
    imageInput.value = "";
    renderAttachments();
  });

  function dataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  // The Image button shows for models whose card has the "vision" capability (GET /models).
  let visionModels = new Set();
  // Embedding and rerank models (cards without "text") answer no chat: not offered here.
  let nonChatModels = new Set();

  function showImageButton() {
    imageButton.hidden = !visionModels.has(modelSelect.value);
  }

  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && running && !section.hidden) {
      event.preventDefault();
      stop();
    }
  });

  // Models: those with an instance (ready ones first), then whatever /v1/models serves.
  let servedIds = [];
  let instanceKey = "";

  function selectModel(model) {
    if (![...modelSelect.options].some((o) => o.value === model)) {
      modelSelect.append(el("option", { value: model, text: model }));
    }
    modelSelect.value = model;
  }

  function renderModels() {
    const state = store.state;
    const wanted = active?.model || modelSelect.value;
    const placed = new Map();
    for (const instance of Object.values(state?.instances ?? {})) {
      const model = instance.shard_assignments.model_id;
      const status = instanceStatus(state, instance);
      if (placed.get(model) !== "ready") placed.set(model, status);
    }
    const ids = [...placed.keys()].filter((id) => !nonChatModels.has(id)).sort((a, b) => (placed.get(a) === "ready" ? 0 : 1) - (placed.get(b) === "ready" ? 0 : 1));
    for (const id of servedIds) if (!placed.has(id) && !nonChatModels.has(id)) ids.push(id);
    replace(
      modelSelect,
      ids.length ? null : el("option", { value: "", text: "No model served: launch one" }),
      ids.map((id) => el("option", { value: id, text: placed.has(id) ? `${id} (${placed.get(id)})` : `${id} (loads on request)` })),
    );
    if (wanted && ids.includes(wanted)) modelSelect.value = wanted;
    showImageButton();
  }

  async function refreshServed() {
    try {
      const models = await apiJson("/v1/models");
      servedIds = models.data.map((m) => m.id);
      const cards = await apiJson("/models");
      visionModels = new Set(cards.filter((card) => card.capabilities.includes("vision")).map((card) => card.model_id));
      nonChatModels = new Set(cards.filter((card) => !card.capabilities.includes("text")).map((card) => card.model_id));
    } catch (error) {
      console.warn("GET /v1/models or /models failed", error);
    }
    renderModels();
  }

  subscribe(({ state }) => {
    if (!state) return;
    const key = Object.values(state.instances)
      .map((i) => `${i.instance_id}:${instanceStatus(state, i)}`)
      .sort()
      .join(",");
    if (key !== instanceKey) {
      instanceKey = key;
      refreshServed();
    }
  });

  writeSettings();
  renderList();
  renderMessages();
  refreshServed();
  return { onShow: () => input.focus() };
}
