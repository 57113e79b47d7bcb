// Integrations view: ready-to-paste settings for the tools people already use, with this
// node's real address (location.origin) and the model of a running instance.

import { auth } from "./api.js";
import { instanceStatus } from "./runners.js";
import { store, subscribe } from "./store.js";
import { copyText, el, replace } from "./ui.js";

const KEY_VAR = "EXO_API_KEY";

/** The model the snippets name: a ready instance's, else any instance's, else the default. */
export function snippetModel(state) {
  const instances = Object.values(state?.instances ?? {});
  const ready = instances.find((i) => instanceStatus(state, i) === "ready") ?? instances[0];
  return ready?.shard_assignments.model_id ?? "HuggingFaceTB/SmolLM2-135M-Instruct";
}

/** [{id, title, language, code, note}] for `origin`, `model`, and whether keys are on. */
export function snippets(origin, model, keysOn) {
  const key = keysOn ? `os.environ["${KEY_VAR}"]` : '"unused"';
  const jsKey = keysOn ? `process.env.${KEY_VAR}` : '"unused"';
  const curlAuth = keysOn ? `\n  -H "Authorization: Bearer $${KEY_VAR}" \\` : "";
  const keyNote = keysOn
    ? `API keys are on: export ${KEY_VAR}=<your key> first.`
    : "API keys are off on this node: any key value works.";
  return [
    {
      id: "openai-python",
      title: "OpenAI Python SDK",
      language: "python",
      code: `${keysOn ? "import os\n" : ""}from openai import OpenAI

client = OpenAI(base_url="${origin}/v1", api_key=${key})
reply = client.chat.completions.create(
    model="${model}",
    messages=[{"role": "user", "content": "Hello!"}],
    max_tokens=64,
)
print(reply.choices[0].message.content)`,
      note: keyNote,
    },
    {
      id: "openai-js",
      title: "OpenAI JavaScript SDK",
      language: "javascript",
      code: `import OpenAI from "openai";

const client = new OpenAI({ baseURL: "${origin}/v1", apiKey: ${jsKey} });
const reply = await client.chat.completions.create({
  model: "${model}",
  messages: [{ role: "user", content: "Hello!" }],
  max_tokens: 64,
});
console.log(reply.choices[0].message.content);`,
      note: keyNote,
    },
    {
      id: "anthropic-python",
      title: "Anthropic Python SDK",
      language: "python",
      code: `${keysOn ? "import os\n" : ""}from anthropic import Anthropic

client = Anthropic(base_url="${origin}", api_key=${key})
reply = client.messages.create(
    model="${model}",
    max_tokens=64,
    messages=[{"role": "user", "content": "Hello!"}],
)
print(reply.content[0].text)`,
      note: "The SDK adds /v1/messages to the base URL itself.",
    },
    {
      id: "claude-code",
      title: "Claude Code",
      language: "shell",
      code: `export ANTHROPIC_BASE_URL="${origin}"
export ANTHROPIC_AUTH_TOKEN="${keysOn ? `$${KEY_VAR}` : "unused"}"
export ANTHROPIC_MODEL="${model}"
export ANTHROPIC_DEFAULT_HAIKU_MODEL="${model}"
claude`,
      note: "Claude Code speaks the Claude Messages API, which this node serves (its system-role messages and beta headers included). Its default prompt is ~12.4k tokens (Claude Code 2.1.332), so a model with an 8K context such as SmolLM2 cannot serve it: use a model with a context of 32k tokens or more, and the largest the cluster runs; small models follow its tool-heavy prompts poorly. Instead of the two model variables, the node can serve every claude-* name: exo --model-alias 'claude-*=<model>'.",
    },
    {
      id: "codex",
      title: "Codex (~/.codex/config.toml)",
      language: "toml",
      code: `model = "${model}"
model_provider = "exo"

[model_providers.exo]
name = "exo"
base_url = "${origin}/v1"
wire_api = "responses"${keysOn ? `\nenv_key = "${KEY_VAR}"` : ""}`,
      note: "Current Codex releases accept only wire_api = \"responses\" (the OpenAI Responses API, served here at /v1/responses, zstd-compressed bodies and namespace tools included). Its hosted web_search tool is not offered to the model. Codex's prompt with its tools is ~10k tokens: use a model with a context of 32k tokens or more. codex --oss also works: OLLAMA_HOST points it at this node.",
    },
    {
      id: "opencode",
      title: "opencode (opencode.json)",
      language: "json",
      code: `{
  "$schema": "https://opencode.ai/config.json",
  "provider": {
    "exo": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "exo",
      "options": { "baseURL": "${origin}/v1"${keysOn ? `, "apiKey": "{env:${KEY_VAR}}"` : ""} },
      "models": { "${model}": { "name": "${model}" } }
    }
  },
  "model": "exo/${model}"
}`,
      note: "opencode speaks Chat Completions through its OpenAI-compatible provider. Its prompt with tools is ~10k tokens: use a model with a context of 32k tokens or more.",
    },
    {
      id: "continue",
      title: "Continue (~/.continue/config.yaml)",
      language: "yaml",
      code: `name: exo
version: 1.0.0
schema: v1
models:
  - name: exo
    provider: openai
    model: ${model}
    apiBase: ${origin}/v1
    apiKey: ${keysOn ? `\${{ secrets.${KEY_VAR} }}` : "unused"}
    roles: [chat, edit, apply]`,
      note: "Continue (its VS Code and JetBrains extensions and its cn CLI) speaks Chat Completions through its openai provider. Agent mode sends its tools with every prompt: use a model with a context of 32k tokens or more.",
    },
    {
      id: "open-webui",
      title: "Open WebUI",
      language: "shell",
      code: `OPENAI_API_BASE_URL="${origin}/v1"
OPENAI_API_KEY="${keysOn ? `$${KEY_VAR}` : "unused"}"
DEFAULT_MODELS="${model}"`,
      note: `Set these in Open WebUI's environment before its first start, later under Admin Settings → Connections → OpenAI API; OFFLINE_MODE=True without internet. For its Ollama connection, OLLAMA_BASE_URL="${origin}" (both at once: give each a prefix_id, see the docs). Its chats carry ~7k tokens of built-in tools: use a model with a context of 8k tokens or more. Open WebUI in Docker reaches this machine at host.docker.internal, not localhost.`,
    },
    {
      id: "ollama-cli",
      title: "Ollama CLI",
      language: "shell",
      code: `OLLAMA_HOST="${origin}" ollama run ${model} "Hello!"
OLLAMA_HOST="${origin}" ollama list`,
      note: "The node serves Ollama's API at its root (/api/...) as Ollama does, and under /ollama too. Not tried with the CLI itself here; the Python client below is tested against the node. The CLI sends no API key: with keys on, use the Python client or curl.",
    },
    {
      id: "ollama-python",
      title: "Ollama Python client",
      language: "python",
      code: `${keysOn ? "import os\n" : ""}from ollama import Client

client = Client(host="${origin}"${keysOn ? `, headers={"Authorization": f"Bearer {os.environ['${KEY_VAR}']}"}` : ""})
reply = client.chat(
    model="${model}",
    messages=[{"role": "user", "content": "Hello!"}],
    options={"num_predict": 64},
)
print(reply.message.content)`,
      note: "",
    },
    {
      id: "curl",
      title: "curl",
      language: "shell",
      code: `curl ${origin}/v1/chat/completions \\${curlAuth}
  -H "Content-Type: application/json" \\
  -d '{"model": "${model}", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64}'`,
      note: "",
    },
  ];
}

export function mountIntegrations(section) {
  const root = section.querySelector("#integrations-root");
  const intro = el("p", { class: "muted" });
  const list = el("div", { id: "snippets" });
  root.append(intro, list);
  let lastKey = "";

  function render() {
    const model = snippetModel(store.state);
    const key = `${model}|${auth.required}`;
    if (key === lastKey) return;
    lastKey = key;
    intro.textContent = `This node answers at ${location.origin}. The snippets name ${model}, the model of a running instance.`;
    replace(
      list,
      snippets(location.origin, model, auth.required).map((s) =>
        el(
          "section",
          { class: "snippet card", id: `snippet-${s.id}`, "data-snippet": s.id },
          el("h2", { text: s.title }),
          el("pre", {}, el("code", { class: `language-${s.language}`, text: s.code })),
          el("div", { class: "row-actions" }, el("button", { type: "button", text: "Copy", onclick: () => copyText(s.code) })),
          s.note ? el("p", { class: "note", text: s.note }) : null,
        ),
      ),
    );
  }

  subscribe(() => {
    if (!section.hidden) render();
  });
  return { onShow: render };
}
