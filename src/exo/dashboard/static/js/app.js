// The dashboard's entry point: theme, hash routing between the five views, the live
// indicator, and the connection to the node's state stream.

import { mountChat } from "./chat.js";
import { mountCluster } from "./cluster.js";
import { mountIntegrations } from "./integrations.js";
import { mountLaunch } from "./launch.js";
import { mountModels } from "./models.js";
import { connect, store, subscribe } from "./store.js";
import { toast } from "./ui.js";

const VIEWS = {
  cluster: mountCluster,
  models: mountModels,
  launch: mountLaunch,
  chat: mountChat,
  integrations: mountIntegrations,
};
const mounted = new Map();

function currentView() {
  const name = location.hash.replace(/^#\/?/, "").split("/")[0];
  return Object.hasOwn(VIEWS, name) ? name : "cluster";
}

function show() {
  const name = currentView();
  for (const view of Object.keys(VIEWS)) {
    document.getElementById(`view-${view}`).hidden = view !== name;
  }
  for (const link of document.querySelectorAll(".tabs a")) {
    if (link.dataset.view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  if (!mounted.has(name)) mounted.set(name, VIEWS[name](document.getElementById(`view-${name}`)));
  mounted.get(name)?.onShow?.();
  document.title = `exo · ${name[0].toUpperCase()}${name.slice(1)}`;
}

// Light / dark: the system's choice until the toggle sets one (kept in localStorage).
const THEME_KEY = "exo.theme";

function applyTheme(theme) {
  if (theme) document.documentElement.dataset.theme = theme;
  else delete document.documentElement.dataset.theme;
}

function effectiveTheme() {
  return (
    document.documentElement.dataset.theme ||
    (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light")
  );
}

applyTheme(localStorage.getItem(THEME_KEY));
document.getElementById("theme-toggle").addEventListener("click", () => {
  const next = effectiveTheme() === "dark" ? "light" : "dark";
  localStorage.setItem(THEME_KEY, next);
  applyTheme(next);
});

const indicator = document.getElementById("live-indicator");
subscribe(() => {
  indicator.textContent = store.connected ? "live" : "reconnecting…";
  indicator.classList.toggle("offline", !store.connected);
});

window.addEventListener("hashchange", show);
show();
connect().catch((error) => {
  indicator.textContent = "offline";
  indicator.classList.add("offline");
  toast(`Cannot reach the node: ${error.message}`, "error");
});
