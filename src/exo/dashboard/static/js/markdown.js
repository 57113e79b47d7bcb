// Model output as safe HTML: `marked` parses the Markdown with raw HTML turned into plain
// text (a model's `<script>` or `<img onerror>` shows as the characters it wrote) and
// images turned into links (the page loads nothing a model names); DOMPurify then
// sanitizes the result again before it reaches the DOM.

import { Marked } from "../vendor/marked.esm.js";
import { copyText, el } from "./ui.js";

function escapeHtml(text) {
  return text
    .replaceAll("&", "&amp;")
    .replaceAll("<", "&lt;")
    .replaceAll(">", "&gt;")
    .replaceAll('"', "&quot;")
    .replaceAll("'", "&#39;");
}

const parser = new Marked({
  gfm: true,
  breaks: true,
  renderer: {
    html(token) {
      return escapeHtml(token.text ?? token.raw ?? "");
    },
    image(token) {
      const label = escapeHtml(token.text || token.href || "image");
      return `<a href="${escapeHtml(token.href || "")}">[image: ${label}]</a>`;
    },
  },
});

let purifier = null;

function sanitizer() {
  if (purifier) return purifier;
  const DOMPurify = window.DOMPurify;
  if (!DOMPurify?.sanitize) throw new Error("DOMPurify did not load");
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
  purifier = DOMPurify;
  return purifier;
}

const PURIFY_CONFIG = {
  USE_PROFILES: { html: true },
  // Inline styles would be refused by the page's CSP (and logged); forms and media are
  // never part of an answer.
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "img", "video", "audio", "iframe"],
  FORBID_ATTR: ["style", "class", "id"],
};

/** Sanitized HTML of `text` rendered as Markdown. */
export function markdownToHtml(text) {
  const html = parser.parse(text ?? "", { async: false });
  return sanitizer().sanitize(html, PURIFY_CONFIG);
}

/** Fills `target` with `text` rendered as Markdown, with a copy button on each code block. */
export function renderMarkdown(target, text) {
  target.innerHTML = markdownToHtml(text);
  for (const pre of target.querySelectorAll("pre")) {
    const code = pre.textContent;
    pre.append(
      el("button", {
        type: "button",
        class: "code-copy",
        text: "Copy",
        "aria-label": "Copy code",
        onclick: () => copyText(code),
      }),
    );
  }
}
