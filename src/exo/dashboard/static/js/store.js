// The cluster state, kept live from the node's `GET /events` stream: a `snapshot` event
// replaces the whole state, each `patch` event applies RFC 6902 ops to it. Views subscribe
// and are called (at most once per animation frame) with the current state.

import { apiFetch, apiJson } from "./api.js";
import { applyPatch } from "./jsonpatch.js";

const listeners = new Set();

export const store = {
  state: null,
  index: -1,
  /** This node's view: {node_id, master, peers}, refreshed when the node set changes. */
  cluster: null,
  connected: false,
};

let frameRequested = false;

function notify() {
  if (frameRequested) return;
  frameRequested = true;
  requestAnimationFrame(() => {
    frameRequested = false;
    for (const listener of listeners) {
      try {
        listener(store);
      } catch (error) {
        console.warn("view update failed", error);
      }
    }
  });
}

/** Calls `listener(store)` now (when a state is there) and after every change. */
export function subscribe(listener) {
  listeners.add(listener);
  if (store.state) listener(store);
  return () => listeners.delete(listener);
}

let source = null;
let nodeKeys = "";
let clusterTimer = null;

async function refreshCluster() {
  try {
    store.cluster = await apiJson("/cluster");
    notify();
  } catch (error) {
    console.warn("GET /cluster failed", error);
  }
}

function nodesChanged() {
  const keys = Object.keys(store.state?.node_info ?? {})
    .sort()
    .join(",");
  if (keys !== nodeKeys) {
    nodeKeys = keys;
    refreshCluster();
  }
}

/** Opens the stream (first making sure the API lets this browser in: a 401 shows the key
 * screen, and EventSource then carries the session cookie). */
export async function connect() {
  const probe = await apiFetch("/node_id", { headers: { accept: "application/json" } });
  if (!probe.ok) throw new Error(`GET /node_id answered ${probe.status}`);
  open();
  // The master can change without the node set changing: look again now and then.
  clusterTimer ??= setInterval(refreshCluster, 5000);
}

function open() {
  source?.close();
  source = new EventSource("/events");
  source.addEventListener("snapshot", (event) => {
    const data = JSON.parse(event.data);
    store.state = data.state;
    store.index = data.index;
    store.connected = true;
    nodesChanged();
    notify();
  });
  source.addEventListener("patch", (event) => {
    const data = JSON.parse(event.data);
    if (!store.state) return;
    try {
      store.state = applyPatch(store.state, data.patch);
      store.index = data.index;
    } catch (error) {
      // Out of step with the node: start again from a fresh snapshot.
      console.warn("state patch failed; reconnecting", error);
      store.state = null;
      open();
      return;
    }
    nodesChanged();
    notify();
  });
  source.addEventListener("open", () => {
    store.connected = true;
    notify();
  });
  source.addEventListener("error", () => {
    store.connected = false;
    notify();
    if (source.readyState === EventSource.CLOSED) {
      // The browser gave up (e.g. a 401 after the cookie expired): sign in, then reopen.
      setTimeout(() => connect().catch(() => {}), 2000);
    }
  });
}
