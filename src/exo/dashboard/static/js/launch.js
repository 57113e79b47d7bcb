// Launch view: pick a model, sharding and node count; the node's placement previews show
// the layers and memory each node would take (or why the placement is impossible); launch;
// the running instances with each runner's state, deletable; and the models that could not
// load, with the reason, until the cluster forgets the failure.

import { apiJson } from "./api.js";
import { describeRunner, instanceStatus } from "./runners.js";
import { store, subscribe } from "./store.js";
import { actionButton, bar, el, formatBytes, replace, shortId, toast } from "./ui.js";

function nodeLabel(state, nodeId) {
  return `${state?.node_info[nodeId]?.friendly_name ?? "?"} ${shortId(nodeId)}`;
}

/** A valid preview's predicted speed line (the nodes' measured speeds and links), or why
 * there is none. */
function predictedSpeed(preview) {
  if (preview.error) return null;
  const rate = preview.predicted_decode_tokens_per_second;
  const ttft = preview.predicted_ttft_seconds;
  if (typeof rate !== "number" || typeof ttft !== "number") {
    return el("p", { class: "muted prediction", text: "Speed not predicted yet: a node has not measured its speed." });
  }
  const prompt = preview.prediction_prompt_tokens;
  return el("p", { class: "muted prediction", text: `Predicted ${rate.toFixed(1)} tok/s decode · TTFT ${ttft.toFixed(2)} s for a ${prompt}-token prompt` });
}

// How long after a model failed to load for good a request that loads it on demand is
// refused at once with that failure (`LoadOnRequest.load_failure_seconds`, 300 s), before
// one places it again.
const LOAD_FAILURE_REFUSED_SECONDS = 300;

/** A model whose instance the master deleted because its runners could not load or warm it
 * up for a reason of the model's own (`State.load_failures`): what failed, when, and what
 * makes the cluster forget it (`LoadFailure` and `State.load_failures` say the same). */
function loadFailureCard(modelId, failure) {
  const failedAt = new Date(failure.failed_at * 1000);
  const refusedUntil = new Date((failure.failed_at + LOAD_FAILURE_REFUSED_SECONDS) * 1000);
  return el(
    "article",
    { class: "card load-failure", "data-model-id": modelId },
    el("h3", {}, modelId, el("span", { class: "badge badge-bad", text: "cannot load" })),
    el("p", { class: "error-text load-failure-reason", text: failure.reason }),
    el("p", { class: "muted load-failure-time", text: `Failed ${failedAt.toLocaleString()}. Requests that load it on demand get this error until ${refusedUntil.toLocaleTimeString()}; then one places it again.` }),
    el("p", { class: "muted load-failure-forgotten", text: "Forgotten when the model is added again, a node completes a download of it, or an instance of it becomes ready." }),
  );
}

/** Which nodes have measured their speed: the previews change when one reports it. */
function measuredNodes(state) {
  return Object.entries(state?.node_info ?? {}).filter(([, info]) => info.speed).map(([id]) => id).sort().join(",");
}

export function mountLaunch(section) {
  const root = section.querySelector("#launch-root");
  let catalog = [];
  let previews = [];
  let previewsFor = "";
  let previewsKey = "";

  const modelSelect = el("select", { id: "launch-model", "aria-label": "Model" });
  const sharding = el(
    "select",
    { id: "launch-sharding", "aria-label": "Sharding" },
    el("option", { value: "pipeline", text: "Pipeline (split by layers)" }),
    el("option", { value: "tensor", text: "Tensor (split inside layers)" }),
  );
  const nodeCount = el("select", { id: "launch-nodes", "aria-label": "Number of nodes" });
  const launchButton = el("button", { type: "button", class: "primary", id: "launch-button", text: "Launch" });
  const verdict = el("p", { id: "launch-verdict", role: "status" });
  const previewBox = el("div", { id: "previews", class: "cards" });
  const instancesBox = el("div", { id: "instances", class: "cards" });
  const loadFailuresBox = el("div", { id: "load-failures", class: "cards" });
  const loadFailures = el("section", { hidden: true }, el("h2", { text: "Models that could not load" }), loadFailuresBox);

  root.append(
    el(
      "div",
      { class: "toolbar" },
      el("label", {}, "Model", modelSelect),
      el("label", {}, "Sharding", sharding),
      el("label", {}, "Nodes", nodeCount),
      launchButton,
    ),
    verdict,
    el("h2", { text: "Placement previews" }),
    previewBox,
    el("h2", { text: "Instances" }),
    instancesBox,
    loadFailures,
  );

  function chosen() {
    return previews.find((p) => p.sharding === sharding.value && p.node_count === Number(nodeCount.value));
  }

  function renderPreviews() {
    const state = store.state;
    const pick = chosen();
    replace(
      previewBox,
      previews.length
        ? previews.map((p) => {
            const card = el(
              "article",
              {
                class: `card preview ${p.error ? "preview-bad" : "preview-ok"}${p === pick ? " preview-selected" : ""}`,
                "data-sharding": p.sharding,
                "data-node-count": String(p.node_count),
              },
              el("h3", { text: `${p.sharding} on ${p.node_count} node${p.node_count === 1 ? "" : "s"}` }),
              p.error
                ? el("p", { class: "error-text preview-error", text: p.error })
                : el(
                    "ul",
                    { class: "runner-list" },
                    p.node_ids.map((nodeId, i) =>
                      el(
                        "li",
                        { class: "runner" },
                        el("strong", { text: nodeLabel(state, nodeId) }),
                        ` layers ${p.layer_ranges[i][0]}–${p.layer_ranges[i][1]} · ${formatBytes(p.bytes_per_node[i])}`,
                      ),
                    ),
                  ),
              predictedSpeed(p),
            );
            card.addEventListener("click", () => {
              sharding.value = p.sharding;
              nodeCount.value = String(p.node_count);
              renderPreviews();
            });
            return card;
          })
        : el("p", { class: "muted", text: previewsFor ? "Loading previews…" : "Pick a model." }),
    );
    if (!pick) {
      verdict.textContent = previews.length ? `No ${sharding.value} placement over ${nodeCount.value} node(s) is possible: the cluster has ${Object.keys(state?.node_info ?? {}).length} node(s).` : "";
      verdict.className = "error-text";
      launchButton.disabled = true;
    } else if (pick.error) {
      verdict.textContent = `Impossible: ${pick.error}`;
      verdict.className = "error-text";
      launchButton.disabled = true;
    } else {
      verdict.textContent = `Ready to launch on ${pick.node_ids.map((id) => nodeLabel(state, id)).join(", ")}.`;
      verdict.className = "muted";
      launchButton.disabled = false;
    }
  }

  async function loadPreviews(force = false) {
    const modelId = modelSelect.value;
    const key = `${modelId}|${Object.keys(store.state?.node_info ?? {}).sort().join(",")}|${measuredNodes(store.state)}`;
    if (!modelId || (!force && key === previewsKey)) return;
    previewsKey = key;
    previewsFor = modelId;
    previews = [];
    renderPreviews();
    try {
      const answer = await apiJson(`/instance/previews?model_id=${encodeURIComponent(modelId)}`);
      if (modelSelect.value === modelId) previews = answer;
    } catch (error) {
      verdict.textContent = error.message;
      verdict.className = "error-text";
    }
    renderPreviews();
  }

  function renderNodeCounts() {
    const n = Math.max(1, Object.keys(store.state?.node_info ?? {}).length);
    const current = nodeCount.value || "1";
    replace(nodeCount, Array.from({ length: n }, (_, i) => el("option", { value: String(i + 1), text: String(i + 1) })));
    nodeCount.value = Number(current) <= n ? current : "1";
  }

  async function loadCatalog() {
    try {
      catalog = await apiJson("/models");
    } catch (error) {
      toast(`Cannot load the catalog: ${error.message}`, "error");
      return;
    }
    const downloads = Object.values(store.state?.downloads ?? {});
    const held = (id) => downloads.some((d) => d[id]?.kind === "DownloadCompleted");
    const sorted = [...catalog].sort((a, b) => Number(held(b.model_id)) - Number(held(a.model_id)) || a.model_id.localeCompare(b.model_id));
    replace(modelSelect, sorted.map((c) => el("option", { value: c.model_id, text: `${c.model_id}${held(c.model_id) ? " (downloaded)" : ""}` })));
    fromHash();
    loadPreviews(true);
  }

  function fromHash() {
    const wanted = decodeURIComponent(location.hash.split("/").slice(2).join("/"));
    if (wanted && catalog.some((c) => c.model_id === wanted)) modelSelect.value = wanted;
  }

  modelSelect.addEventListener("change", () => loadPreviews(true));
  sharding.addEventListener("change", renderPreviews);
  nodeCount.addEventListener("change", renderPreviews);
  launchButton.addEventListener("click", async () => {
    const pick = chosen();
    if (!pick || pick.error) return;
    launchButton.disabled = true;
    try {
      const answer = await apiJson("/place_instance", {
        method: "POST",
        body: { model_id: pick.model_id, sharding: pick.sharding, min_nodes: pick.node_count, node_ids: pick.node_ids },
      });
      toast(`Launched ${answer.model_id} (instance ${shortId(answer.instance_id)})`);
    } catch (error) {
      toast(`Cannot launch: ${error.message}`, "error");
    } finally {
      launchButton.disabled = false;
    }
  });

  function instanceCard(state, instance) {
    const assignments = instance.shard_assignments;
    const status = instanceStatus(state, instance);
    const unavailable = state.unavailable_instances[instance.instance_id];
    const failures = state.instance_failures[instance.instance_id] ?? 0;
    return el(
      "article",
      { class: "card instance", "data-instance-id": instance.instance_id, "data-status": status },
      el(
        "h3",
        {},
        assignments.model_id,
        el("span", { class: `badge ${status === "ready" ? "badge-ok" : status === "failed" || status === "unavailable" ? "badge-bad" : ""} instance-status`, text: status }),
      ),
      el("p", { class: "muted", text: `${instance.sharding} · ${Object.keys(assignments.node_to_runner).length} node(s) · ${shortId(instance.instance_id)}` }),
      unavailable ? el("p", { class: "error-text", text: unavailable.reason }) : null,
      failures ? el("p", { class: "error-text", text: `${failures} runner failure(s) since it was last ready` }) : null,
      el(
        "ul",
        { class: "runner-list" },
        Object.entries(assignments.node_to_runner).map(([nodeId, runnerId]) => {
          const shard = assignments.runner_to_shard[runnerId];
          const described = describeRunner(state, runnerId);
          return el(
            "li",
            { class: `runner runner-${described.tone}`, "data-runner-id": runnerId },
            el("strong", { text: nodeLabel(state, nodeId) }),
            shard ? ` rank ${shard.device_rank}/${shard.world_size} · layers ${shard.start_layer}–${shard.end_layer} ` : " ",
            el("span", { class: "runner-status", text: described.label }),
            described.progress !== null ? bar(described.progress, "progress") : null,
            described.detail ? el("div", { class: "runner-detail", text: described.detail }) : null,
          );
        }),
      ),
      el(
        "div",
        { class: "row-actions" },
        status === "ready" ? el("a", { href: "#/chat", text: "Chat" }) : null,
        actionButton(
          "Delete",
          async () => {
            await apiJson(`/instance/${encodeURIComponent(instance.instance_id)}`, { method: "DELETE" });
            toast(`Deleting instance ${shortId(instance.instance_id)}`);
          },
          { class: "danger delete-instance" },
        ),
      ),
    );
  }

  subscribe(({ state }) => {
    if (!state) return;
    if (nodeCount.options.length !== Math.max(1, Object.keys(state.node_info).length)) {
      renderNodeCounts();
    }
    loadPreviews(); // only when the node set or the nodes that measured their speed changed
    const instances = Object.values(state.instances);
    replace(instancesBox, instances.length ? instances.map((i) => instanceCard(state, i)) : el("p", { class: "muted", text: "No instance: launch a model above." }));
    const failures = Object.entries(state.load_failures ?? {}).reverse(); // newest first
    loadFailures.hidden = failures.length === 0;
    replace(loadFailuresBox, failures.map(([modelId, failure]) => loadFailureCard(modelId, failure)));
  });

  renderNodeCounts();
  loadCatalog();
  return {
    onShow: () => {
      fromHash();
      loadPreviews(true);
    },
  };
}
