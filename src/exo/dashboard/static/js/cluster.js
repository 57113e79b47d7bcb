// Cluster view: the topology picture (SVG) of the nodes and their measured links, and one
// card per node with its hardware and runners.

import { describeRunner, runnerIndex } from "./runners.js";
import { subscribe } from "./store.js";
import { bar, el, formatBytes, replace, shortId, svg } from "./ui.js";

const NODE_W = 210;
const NODE_H = 104;

/** A node's name for labels: its friendly name, with its short id when another node has
 * the same name. */
function nodeName(state, nodeId) {
  const name = state.node_info[nodeId]?.friendly_name;
  if (!name) return shortId(nodeId);
  const twins = Object.values(state.node_info).filter((info) => info.friendly_name === name);
  return twins.length > 1 ? `${name} ${shortId(nodeId)}` : name;
}

/** Positions on a circle (one node: the centre). */
function layout(nodeIds, width, height) {
  const cx = width / 2;
  const cy = height / 2;
  if (nodeIds.length === 1) return new Map([[nodeIds[0], [cx, cy]]]);
  const rx = width / 2 - NODE_W / 2 - 10;
  const ry = height / 2 - NODE_H / 2 - 10;
  if (nodeIds.length === 2 && width >= 800) {
    return new Map([
      [nodeIds[0], [cx - rx, cy]],
      [nodeIds[1], [cx + rx, cy]],
    ]);
  }
  return new Map(
    nodeIds.map((id, i) => {
      const angle = -Math.PI / 2 + (2 * Math.PI * i) / nodeIds.length;
      return [id, [cx + rx * Math.cos(angle), cy + ry * Math.sin(angle)]];
    }),
  );
}

function linkLabel(edge) {
  if (!edge) return "";
  return `${edge.latency_ms.toFixed(edge.latency_ms < 10 ? 2 : 0)} ms · ${Math.round(edge.bandwidth_mbps)} Mbit/s`;
}

function topologySvg(state, master, self, available) {
  const nodeIds = Object.keys(state.node_info).sort();
  // Narrow screens get a narrower picture (so its text stays readable) that grows down.
  const narrow = available < 600;
  const width = narrow ? 440 : 800;
  const n = nodeIds.length;
  const height = n <= 1 ? 150 : narrow ? Math.max(300, n * 150) : n === 2 ? 180 : 420;
  const positions = layout(nodeIds, width, height);
  const lost = new Set(state.lost_nodes);
  const picture = svg("svg", {
    viewBox: `0 0 ${width} ${height}`,
    class: "topology",
    role: "img",
    "aria-label": `Topology of ${nodeIds.length} node${nodeIds.length === 1 ? "" : "s"}`,
  });
  // Links: one line per pair, labelled with each direction's measurement.
  const drawn = new Set();
  for (const [source, sinks] of Object.entries(state.topology)) {
    for (const sink of Object.keys(sinks)) {
      const pair = [source, sink].sort().join("|");
      if (drawn.has(pair) || !positions.has(source) || !positions.has(sink)) continue;
      drawn.add(pair);
      const [x1, y1] = positions.get(source);
      const [x2, y2] = positions.get(sink);
      const forward = state.topology[source]?.[sink];
      const backward = state.topology[sink]?.[source];
      const group = svg("g", { class: "link", "data-link": pair });
      group.append(svg("line", { x1, y1, x2, y2 }));
      const mx = (x1 + x2) / 2;
      const my = (y1 + y2) / 2;
      const lines = [forward, backward].filter(Boolean);
      lines.forEach((edge, i) => {
        group.append(
          svg(
            "text",
            { x: mx, y: my - 8 + i * 24, "text-anchor": "middle", class: "link-label" },
            `${nodeName(state, edge.source)}→${nodeName(state, edge.sink)}: ${linkLabel(edge)}`,
          ),
        );
      });
      picture.append(group);
    }
  }
  for (const nodeId of nodeIds) {
    const info = state.node_info[nodeId];
    const [x, y] = positions.get(nodeId);
    const used = info.memory.total_bytes - info.memory.available_bytes;
    const fraction = info.memory.total_bytes ? used / info.memory.total_bytes : 0;
    const classes = ["node"];
    if (nodeId === master) classes.push("master");
    if (lost.has(nodeId)) classes.push("lost");
    const left = x - NODE_W / 2;
    const top = y - NODE_H / 2;
    const gpu = info.gpus.length
      ? info.gpus.map((g) => `${g.name} ${formatBytes(g.total_memory_bytes)}`).join(", ")
      : "no GPU";
    const group = svg(
      "g",
      { class: classes.join(" "), "data-node-id": nodeId },
      svg("title", {}, nodeId),
      svg("rect", { x: left, y: top, width: NODE_W, height: NODE_H, rx: 10 }),
      svg(
        "text",
        { x: left + 10, y: top + 20, class: "node-name" },
        `${nodeId === master ? "★ " : ""}${info.friendly_name} · ${shortId(nodeId)}${nodeId === self ? " (this)" : ""}`,
      ),
      svg(
        "text",
        { x: left + 10, y: top + 40, class: "node-detail" },
        `RAM ${formatBytes(used)} / ${formatBytes(info.memory.total_bytes)}`,
      ),
      svg("rect", { x: left + 10, y: top + 46, width: NODE_W - 20, height: 6, class: "mem-bg" }),
      svg("rect", {
        x: left + 10,
        y: top + 46,
        width: Math.max(1, (NODE_W - 20) * fraction),
        height: 6,
        class: "mem-fill",
      }),
      svg(
        "text",
        { x: left + 10, y: top + 68, class: "node-detail" },
        `CPU ${Math.round(info.cpu_percent ?? 0)}% busy · ${info.cpu_cores} cores`,
      ),
      svg(
        "text",
        { x: left + 10, y: top + 86, class: "node-detail" },
        `${gpu.slice(0, 20)} · disk ${formatBytes(info.models_disk_free_bytes)} free`,
      ),
    );
    picture.append(group);
  }
  return picture;
}

function nodeCard(state, nodeId, master, self, runnersByNode) {
  const info = state.node_info[nodeId];
  const used = info.memory.total_bytes - info.memory.available_bytes;
  const runners = runnersByNode.get(nodeId) ?? [];
  const lost = state.lost_nodes.includes(nodeId);
  return el(
    "article",
    { class: `card node-card${lost ? " lost" : ""}`, "data-node-id": nodeId },
    el(
      "h2",
      {},
      info.friendly_name,
      " ",
      el("code", { text: shortId(nodeId), title: nodeId }),
      nodeId === master ? el("span", { class: "badge badge-master", text: "master" }) : null,
      nodeId === self ? el("span", { class: "badge", text: "this node" }) : null,
      lost ? el("span", { class: "badge badge-bad", text: "lost" }) : null,
      info.offline ? el("span", { class: "badge", text: "offline" }) : null,
    ),
    el(
      "dl",
      { class: "facts" },
      el("dt", { text: "Memory" }),
      el(
        "dd",
        {},
        `${formatBytes(used)} used of ${formatBytes(info.memory.total_bytes)}`,
        bar(info.memory.total_bytes ? used / info.memory.total_bytes : 0, "memory used"),
      ),
      el("dt", { text: "CPU" }),
      el(
        "dd",
        {},
        `${Math.round(info.cpu_percent ?? 0)}% busy · ${info.cpu_model || "unknown"} (${info.cpu_cores} cores)`,
        bar((info.cpu_percent ?? 0) / 100, "CPU load"),
      ),
      el("dt", { text: "GPU" }),
      el("dd", {
        text: info.gpus.length
          ? info.gpus.map((g) => `${g.name} (${formatBytes(g.total_memory_bytes)})`).join(", ")
          : "none",
      }),
      el("dt", { text: "Disk" }),
      el("dd", {
        text: info.models_disk_total_bytes
          ? `${formatBytes(info.models_disk_free_bytes)} free of ${formatBytes(info.models_disk_total_bytes)} for models`
          : `${formatBytes(info.models_disk_free_bytes)} free for models`,
      }),
      el("dt", { text: "API" }),
      el("dd", { text: info.api_addresses.map((a) => `${a}:${info.api_port}`).join(", ") || "–" }),
    ),
    el("h3", { text: "Runners" }),
    runners.length
      ? el(
          "ul",
          { class: "runner-list" },
          runners.map(({ runnerId, instance, shard }) => {
            const status = describeRunner(state, runnerId);
            return el(
              "li",
              { "data-runner-id": runnerId, class: `runner runner-${status.tone}` },
              el("span", { class: "runner-model", text: instance?.shard_assignments.model_id ?? "?" }),
              shard ? ` layers ${shard.start_layer}–${shard.end_layer} ` : " ",
              el("span", { class: "runner-status", text: status.label }),
              status.progress !== null ? bar(status.progress, "loading") : null,
              status.detail ? el("div", { class: "runner-detail", text: status.detail }) : null,
            );
          }),
        )
      : el("p", { class: "muted", text: "No runners on this node." }),
  );
}

export function mountCluster(section) {
  const topology = section.querySelector("#topology");
  const cards = section.querySelector("#node-cards");
  subscribe(({ state, cluster }) => {
    if (!state) return;
    const master = cluster?.master ?? null;
    const self = cluster?.node_id ?? null;
    const nodeIds = Object.keys(state.node_info).sort();
    const runnersByNode = runnerIndex(state);
    replace(topology, nodeIds.length ? topologySvg(state, master, self, topology.clientWidth || 800) : el("p", { text: "No node has reported yet." }));
    replace(cards, nodeIds.map((id) => nodeCard(state, id, master, self, runnersByNode)));
  });
  return {};
}
