// Models view: the catalog (built-in and added models) with search and filters, which node
// holds which model, download progress with speed and ETA, start / cancel / delete, and
// adding a Hugging Face model by id.

import { apiJson } from "./api.js";
import { downloadLine } from "./runners.js";
import { store, subscribe } from "./store.js";
import { actionButton, bar, el, formatBytes, formatParameters, replace, shortId, toast } from "./ui.js";

const SIZES = [
  ["", "Any size"],
  ["0-1.5", "under 1.5B"],
  ["1.5-5", "1.5B – 5B"],
  ["5-15", "5B – 15B"],
  ["15-40", "15B – 40B"],
  ["40-", "over 40B"],
];

/** "qwen3:0.6b" -> "qwen3"; a model without a short name: its architecture. */
export function familyOf(card) {
  if (card.short_name) return card.short_name.split(":")[0];
  return (card.architecture || "other").replace(/ForCausalLM$|ForConditionalGeneration$/, "").toLowerCase();
}

function inSize(card, range) {
  if (!range) return true;
  const [low, high] = range.split("-").map((x) => (x === "" ? null : Number(x) * 1e9));
  const count = card.parameter_count || 0;
  return (low === null || count >= low) && (high === null || count < high);
}

export function mountModels(section) {
  const root = section.querySelector("#models-root");
  let catalog = [];
  /** model id -> true/false/undefined (unknown yet): a placement preview without error. */
  const fits = new Map();
  let fitsKey = "";

  const search = el("input", { type: "search", id: "model-search", placeholder: "Search models", "aria-label": "Search models" });
  const family = el("select", { id: "model-family", "aria-label": "Family" });
  const size = el("select", { id: "model-size", "aria-label": "Size" }, SIZES.map(([v, t]) => el("option", { value: v, text: t })));
  const caps = Object.fromEntries(
    ["thinking", "tools", "vision"].map((c) => [c, el("input", { type: "checkbox", id: `cap-${c}`, value: c })]),
  );
  const fitOnly = el("input", { type: "checkbox", id: "model-fits" });
  const downloadedOnly = el("input", { type: "checkbox", id: "model-downloaded" });
  const table = el("tbody");
  const count = el("p", { class: "muted", id: "model-count" });
  const addInput = el("input", { type: "text", id: "add-model-id", placeholder: "org/name on Hugging Face, or a local directory", "aria-label": "Hugging Face model id" });
  const addForm = el(
    "form",
    { class: "toolbar", id: "add-model-form" },
    addInput,
    el("button", { type: "submit", class: "primary", text: "Add model" }),
  );
  addForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    const modelId = addInput.value.trim();
    if (!modelId) return;
    const button = addForm.querySelector("button");
    button.disabled = true;
    button.textContent = "Adding…";
    try {
      const answer = await apiJson("/models/add", { method: "POST", body: { model_id: modelId } });
      toast(`Added ${answer.model_id}`);
      addInput.value = "";
      await loadCatalog();
    } catch (error) {
      toast(`Cannot add ${modelId}: ${error.message}`, "error");
    } finally {
      button.disabled = false;
      button.textContent = "Add model";
    }
  });

  root.append(
    el(
      "div",
      { class: "toolbar" },
      search,
      family,
      size,
      Object.entries(caps).map(([name, box]) => el("label", {}, box, name)),
      el("label", { title: "A placement preview of the model has no error on the nodes there are now" }, fitOnly, "fits this cluster"),
      el("label", {}, downloadedOnly, "downloaded"),
    ),
    count,
    el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        { id: "model-table" },
        el("thead", {}, el("tr", {}, ["Model", "Size", "Capabilities", "On nodes", "Actions"].map((h) => el("th", { text: h })))),
        table,
      ),
    ),
    el("h2", { text: "Add a model from Hugging Face" }),
    addForm,
  );

  async function loadCatalog() {
    try {
      catalog = await apiJson("/models");
    } catch (error) {
      toast(`Cannot load the catalog: ${error.message}`, "error");
      return;
    }
    const families = [...new Set(catalog.map(familyOf))].sort();
    const chosen = family.value;
    replace(family, el("option", { value: "", text: "Any family" }), families.map((f) => el("option", { value: f, text: f })));
    family.value = families.includes(chosen) ? chosen : "";
    fitsKey = "";
    render();
  }

  /** Asks the node for each model's placement previews when the node set changes. */
  async function refreshFits() {
    const state = store.state;
    const key = Object.entries(state?.node_info ?? {})
      .map(([id, info]) => `${id}:${Math.round(info.memory.available_bytes / 1e8)}`)
      .sort()
      .join(",");
    if (!state || key === fitsKey || !catalog.length) return;
    fitsKey = key;
    await Promise.all(
      catalog.map(async (card) => {
        try {
          const previews = await apiJson(`/instance/previews?model_id=${encodeURIComponent(card.model_id)}`);
          fits.set(card.model_id, previews.some((p) => !p.error));
        } catch {
          fits.set(card.model_id, false);
        }
      }),
    );
    render();
  }

  function downloadCell(card, state) {
    const cells = [];
    for (const nodeId of Object.keys(state?.node_info ?? {}).sort()) {
      const status = state.downloads[nodeId]?.[card.model_id];
      if (!status) continue;
      const name = state.node_info[nodeId].friendly_name || shortId(nodeId);
      const label = `${name} ${shortId(nodeId)}`;
      const line = el("div", { class: "download", "data-node-id": nodeId, "data-kind": status.kind });
      switch (status.kind) {
        case "DownloadCompleted":
          line.append(el("span", { class: "badge badge-ok", text: `✓ ${label}` }));
          break;
        case "DownloadPending":
          line.append(el("span", { class: "badge", text: `${label}: pending` }));
          break;
        case "DownloadFailed":
          line.append(el("span", { class: "badge badge-bad", text: `${label}: failed` }), el("div", { class: "runner-detail error-text", text: status.error_message }));
          break;
        case "DownloadOngoing": {
          const p = status.progress;
          line.append(
            el("span", { class: "badge", text: `${label}: downloading` }),
            p ? bar(p.total_bytes ? p.downloaded_bytes / p.total_bytes : 0, `download of ${card.model_id} on ${name}`) : null,
            el("div", { class: "runner-detail", text: p ? downloadLine(p) : status.message }),
          );
          break;
        }
        default:
          line.append(el("span", { class: "badge", text: `${label}: ${status.kind}` }));
      }
      cells.push(line);
    }
    return cells.length ? cells : el("span", { class: "muted", text: "not downloaded" });
  }

  function actions(card, state) {
    const nodeIds = Object.keys(state?.node_info ?? {}).sort();
    const target = el(
      "select",
      { "aria-label": `Node for ${card.model_id}`, class: "node-select" },
      nodeIds.map((id) => el("option", { value: id, text: `${state.node_info[id].friendly_name} ${shortId(id)}` })),
    );
    // This node when known, else the node already downloading (or holding) the model.
    const own = store.cluster?.node_id;
    const holder = nodeIds.find((id) => state?.downloads?.[id]?.[card.model_id]);
    if (own && nodeIds.includes(own)) target.value = own;
    else if (holder) target.value = holder;
    const status = () => state?.downloads[target.value]?.[card.model_id];
    const control = (action) => async () => {
      if (action === "delete") {
        await apiJson(`/download/${encodeURIComponent(target.value)}/${card.model_id}`, { method: "DELETE" });
      } else {
        await apiJson(`/download/${action}`, { method: "POST", body: { model: card.model_id, node_id: target.value } });
      }
      toast(`${action} ${card.model_id}: sent`);
    };
    const buttons = el("div", { class: "row-actions" });
    const update = () => {
      const kind = status()?.kind;
      replace(
        buttons,
        kind === "DownloadOngoing" || kind === "DownloadPending"
          ? actionButton("Cancel", control("cancel"), { class: "cancel-download" })
          : kind === "DownloadCompleted"
            ? actionButton("Delete files", control("delete"), { class: "danger delete-download" })
            : actionButton("Download", control("start"), { class: "start-download" }),
        el("a", { href: `#/launch/${encodeURIComponent(card.model_id)}`, text: "Launch" }),
        state?.custom_cards?.[card.model_id]
          ? actionButton("Remove model", async () => {
              await apiJson(`/models/custom/${card.model_id}`, { method: "DELETE" });
              toast(`Removed ${card.model_id}`);
              await loadCatalog();
            }, { class: "danger remove-model" })
          : null,
      );
    };
    target.addEventListener("change", update);
    update();
    return [nodeIds.length > 1 ? target : null, buttons];
  }

  function render() {
    const state = store.state;
    const text = search.value.trim().toLowerCase();
    const wantedCaps = Object.entries(caps).filter(([, box]) => box.checked).map(([name]) => name);
    const shown = catalog.filter((card) => {
      if (text && !`${card.model_id} ${card.short_name ?? ""} ${card.architecture}`.toLowerCase().includes(text)) return false;
      if (family.value && familyOf(card) !== family.value) return false;
      if (!inSize(card, size.value)) return false;
      if (!wantedCaps.every((c) => card.capabilities.includes(c))) return false;
      if (fitOnly.checked && fits.get(card.model_id) !== true) return false;
      if (downloadedOnly.checked && !Object.values(state?.downloads ?? {}).some((d) => d[card.model_id]?.kind === "DownloadCompleted")) return false;
      return true;
    });
    count.textContent = `${shown.length} of ${catalog.length} models${fitOnly.checked && fits.size < catalog.length ? " (checking which fit…)" : ""}`;
    replace(
      table,
      shown.map((card) =>
        el(
          "tr",
          { "data-model-id": card.model_id },
          el("td", {}, el("strong", { text: card.model_id }), card.short_name ? el("div", { class: "muted", text: card.short_name }) : null, card.gated ? el("span", { class: "badge", text: "gated" }) : null, state?.custom_cards?.[card.model_id] ? el("span", { class: "badge", text: "added" }) : null),
          el("td", {}, `${formatParameters(card.parameter_count)} params`, el("div", { class: "muted", text: `${formatBytes(card.storage_size_bytes)} · ${card.n_layers} layers` }), fits.has(card.model_id) ? el("div", { class: fits.get(card.model_id) ? "muted" : "error-text", text: fits.get(card.model_id) ? "fits" : "does not fit" }) : null),
          el("td", {}, card.capabilities.map((c) => el("span", { class: "badge cap", text: c }))),
          el("td", { class: "download-cell" }, downloadCell(card, state)),
          el("td", {}, actions(card, state)),
        ),
      ),
    );
  }

  for (const control of [search, family, size, downloadedOnly, ...Object.values(caps)]) {
    control.addEventListener("input", render);
  }
  fitOnly.addEventListener("change", () => {
    render();
    refreshFits();
  });

  let downloadsKey = "";
  subscribe(({ state }) => {
    if (!state || section.hidden) return;
    const key = JSON.stringify([state.downloads, Object.keys(state.node_info), Object.keys(state.custom_cards)]);
    if (key !== downloadsKey) {
      downloadsKey = key;
      render();
    }
    if (fitOnly.checked) refreshFits();
  });
  loadCatalog();
  return {
    onShow: () => {
      downloadsKey = "";
      render();
    },
  };
}
