// Small DOM and formatting helpers shared by every view. Nothing here writes HTML strings:
// elements are built with createElement, text with textContent (the page runs under a
// Content-Security-Policy without inline styles or scripts).

const SVG_NS = "http://www.w3.org/2000/svg";

/** el("div", {class: "x", onclick: fn, dataset: {id: 1}}, child, "text", [more]) */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  setAttributes(node, attrs);
  append(node, children);
  return node;
}

/** The SVG twin of el(): presentation attributes only, never `style`. */
export function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      node.addEventListener(key.slice(2), value);
    } else {
      node.setAttribute(key, String(value));
    }
  }
  append(node, children);
  return node;
}

function setAttributes(node, attrs) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") {
      node.addEventListener(key.slice(2), value);
    } else if (key in node && typeof value !== "string") node[key] = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
}

/** Replaces every child of `node`. */
export function replace(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

const UNITS = ["B", "KB", "MB", "GB", "TB"];

/** 1234567 -> "1.2 MB" (powers of 1000, as disks and the Hub count). */
export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined || Number.isNaN(bytes)) return "–";
  let value = Number(bytes);
  let unit = 0;
  while (Math.abs(value) >= 1000 && unit < UNITS.length - 1) {
    value /= 1000;
    unit += 1;
  }
  return `${value >= 100 || unit === 0 ? value.toFixed(0) : value.toFixed(1)} ${UNITS[unit]}`;
}

/** Seconds -> "42 s", "3 min 5 s", "1 h 2 min". */
export function formatDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

/** 1_230_000_000 parameters -> "1.2B". */
export function formatParameters(count) {
  if (!count) return "?";
  // As the Ollama API's `parameter_size` (`exo.shared.models.parameter_count.
  // human_parameter_count`): billions to one decimal ("106.9B"); millions and thousands
  // whole at 100 and over ("135M", "337K"), else to one decimal.
  for (const [divisor, suffix] of [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]]) {
    if (count >= divisor) {
      const value = count / divisor;
      return value >= 100 && suffix !== "B" ? `${Math.round(value)}${suffix}` : `${value.toFixed(1)}${suffix}`;
    }
  }
  return String(count);
}

/** The first 8 characters of an id, for labels. */
export function shortId(id) {
  return String(id).slice(0, 8);
}

let toastArea = null;

/** A message at the bottom of the page for a few seconds (errors stay until clicked). */
export function toast(message, kind = "info") {
  if (!toastArea) {
    toastArea = el("div", { class: "toasts", role: "status", "aria-live": "polite" });
    document.body.append(toastArea);
  }
  const item = el("div", { class: `toast toast-${kind}`, text: message });
  item.addEventListener("click", () => item.remove());
  toastArea.append(item);
  setTimeout(() => item.remove(), kind === "error" ? 12000 : 4000);
}

/** A <progress>-like bar whose width is set through the CSSOM (allowed by the CSP). */
export function bar(fraction, label) {
  const fill = el("div", { class: "bar-fill" });
  fill.style.width = `${Math.max(0, Math.min(1, fraction || 0)) * 100}%`;
  return el(
    "div",
    {
      class: "bar",
      role: "progressbar",
      "aria-valuemin": "0",
      "aria-valuemax": "100",
      "aria-valuenow": String(Math.round((fraction || 0) * 100)),
      "aria-label": label || "progress",
    },
    fill,
  );
}

/** A button that runs `action` and shows its error as a toast, disabled while it runs. */
export function actionButton(label, action, attrs = {}) {
  const button = el("button", { type: "button", ...attrs, text: label });
  button.addEventListener("click", async () => {
    button.disabled = true;
    try {
      await action();
    } catch (error) {
      toast(error.message || String(error), "error");
    } finally {
      button.disabled = false;
    }
  });
  return button;
}

/** Copies text to the clipboard, falling back to selecting it. */
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    toast("Copied");
  } catch {
    toast("Copy failed: select the text and copy it by hand", "error");
  }
}
