// Conversations kept in this browser (localStorage), newest first.

const KEY = "exo.conversations.v1";

export const DEFAULT_SETTINGS = { temperature: "", top_p: "", max_tokens: "", seed: "" };

function newId() {
  return crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`;
}

export function loadConversations() {
  try {
    const list = JSON.parse(localStorage.getItem(KEY) || "[]");
    return Array.isArray(list) ? list : [];
  } catch {
    return [];
  }
}

export function saveConversations(list) {
  try {
    localStorage.setItem(KEY, JSON.stringify(list));
  } catch (error) {
    // Full storage: keep the newest conversations that fit.
    if (list.length > 1) saveConversations(list.slice(0, Math.ceil(list.length / 2)));
    else console.warn("conversation not saved", error);
  }
}

export function newConversation(model = "") {
  return {
    id: newId(),
    title: "New chat",
    model,
    system: "",
    settings: { ...DEFAULT_SETTINGS },
    messages: [],
    updatedAt: Date.now(),
  };
}

/** The title a conversation gets from its first question. */
export function titleFrom(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || "New chat";
}
