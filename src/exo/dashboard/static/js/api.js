// Same-origin calls to the node's API. A 401 (API keys are on and this browser has no
// session cookie yet) shows the key screen once; after `POST /auth/session` sets the
// cookie, the request is sent again. EventSource carries the same cookie.

import { el } from "./ui.js";

export class ApiError extends Error {
  constructor(message, status, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

/** Whether this page had to sign in with a key (the snippets then show the key header). */
export const auth = { required: false };

let pendingKeyScreen = null;

/** fetch() that answers 401 with the key screen, then sends the request again. */
export async function apiFetch(path, options = {}) {
  for (let attempt = 0; attempt < 5; attempt += 1) {
    const response = await fetch(path, { credentials: "same-origin", ...options });
    if (response.status !== 401) return response;
    auth.required = true;
    await askForKey();
  }
  throw new ApiError("the API key was not accepted", 401, null);
}

/** The error message of a failed response in any of the API's dialects. */
export async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const error = body.error ?? body.detail ?? body;
    if (typeof error === "string") return error;
    if (error && typeof error.message === "string") return error.message;
    return text;
  } catch {
    return text || `${response.status} ${response.statusText}`;
  }
}

/** JSON of a GET (or any method with `body` as JSON); throws ApiError on a non-2xx. */
export async function apiJson(path, { method = "GET", body } = {}) {
  const options = { method, headers: { accept: "application/json" } };
  if (body !== undefined) {
    options.headers["content-type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await apiFetch(path, options);
  if (!response.ok) {
    throw new ApiError(await errorMessage(response), response.status, null);
  }
  if (response.status === 204) return null;
  return response.json();
}

/** Shows the key screen (once, however many requests wait on it); resolves when the node
 * accepted a key. */
export function askForKey() {
  if (!pendingKeyScreen) {
    pendingKeyScreen = new Promise((resolve) => showKeyScreen(resolve)).finally(() => {
      pendingKeyScreen = null;
    });
  }
  return pendingKeyScreen;
}

function showKeyScreen(done) {
  const input = el("input", {
    type: "password",
    id: "api-key-input",
    name: "api_key",
    autocomplete: "current-password",
    required: true,
    placeholder: "API key",
    "aria-label": "API key",
  });
  const message = el("p", { class: "key-error", role: "alert" });
  const submit = el("button", { type: "submit", class: "primary", id: "api-key-submit", text: "Sign in" });
  const form = el(
    "form",
    { class: "key-form" },
    el("h2", { text: "This node needs an API key" }),
    el("p", {
      text: "The key is sent once; the node then keeps this browser signed in with a cookie.",
    }),
    input,
    submit,
    message,
  );
  const screen = el("div", { class: "key-screen", id: "key-screen" }, form);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    submit.disabled = true;
    message.textContent = "";
    try {
      const response = await fetch("/auth/session", {
        method: "POST",
        credentials: "same-origin",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ api_key: input.value }),
      });
      if (response.ok) {
        screen.remove();
        done();
        return;
      }
      message.textContent =
        response.status === 401 ? "That key is not valid." : await errorMessage(response);
    } catch (error) {
      message.textContent = `The node did not answer: ${error.message}`;
    } finally {
      submit.disabled = false;
    }
  });
  document.body.append(screen);
  input.focus();
}
