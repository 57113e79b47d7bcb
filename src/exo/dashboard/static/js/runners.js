// What a runner is doing, in words, from the cluster state: shared by the cluster and
// launch views.

import { formatBytes, formatDuration } from "./ui.js";

/** node id -> [{runnerId, instance, shard}] for every runner of every instance. */
export function runnerIndex(state) {
  const byNode = new Map();
  for (const instance of Object.values(state.instances)) {
    const assignments = instance.shard_assignments;
    for (const [nodeId, runnerId] of Object.entries(assignments.node_to_runner)) {
      const entry = { runnerId, instance, shard: assignments.runner_to_shard[runnerId] };
      if (!byNode.has(nodeId)) byNode.set(nodeId, []);
      byNode.get(nodeId).push(entry);
    }
  }
  return byNode;
}

function instanceOf(state, runnerId) {
  return Object.values(state.instances).find((i) =>
    Object.hasOwn(i.shard_assignments.runner_to_shard, runnerId),
  );
}

/** A download's line: "412 MB of 1.2 GB · 25 MB/s · 31 s left". */
export function downloadLine(progress) {
  if (!progress) return "";
  const parts = [`${formatBytes(progress.downloaded_bytes)} of ${formatBytes(progress.total_bytes)}`];
  if (progress.speed_bytes_per_second > 0) parts.push(`${formatBytes(progress.speed_bytes_per_second)}/s`);
  if (progress.eta_seconds !== null && progress.eta_seconds !== undefined) {
    parts.push(`${formatDuration(progress.eta_seconds)} left`);
  }
  return parts.join(" · ");
}

/** {label, tone: ok|busy|bad|idle, progress: 0..1 | null, detail} of one runner. */
export function describeRunner(state, runnerId) {
  const status = state.runners[runnerId];
  const nodeId = state.runner_nodes[runnerId];
  const instance = instanceOf(state, runnerId);
  const download = instance && nodeId ? state.downloads[nodeId]?.[instance.shard_assignments.model_id] : null;
  if (!status) return { label: "starting", tone: "busy", progress: null, detail: "" };
  switch (status.kind) {
    case "RunnerIdle":
    case "RunnerConnecting":
    case "RunnerConnected": {
      if (download?.kind === "DownloadOngoing") {
        const p = download.progress;
        return {
          label: "downloading",
          tone: "busy",
          progress: p && p.total_bytes ? p.downloaded_bytes / p.total_bytes : null,
          detail: p ? downloadLine(p) : download.message,
        };
      }
      if (download?.kind === "DownloadFailed") {
        return { label: "download failed", tone: "bad", progress: null, detail: download.error_message };
      }
      const label = { RunnerIdle: "waiting", RunnerConnecting: "connecting", RunnerConnected: "connected" }[status.kind];
      return { label, tone: "busy", progress: null, detail: download?.kind === "DownloadPending" ? "download pending" : "" };
    }
    case "RunnerLoading":
      return {
        label: `loading ${status.layers_loaded}/${status.total_layers} layers`,
        tone: "busy",
        progress: status.total_layers ? status.layers_loaded / status.total_layers : 0,
        detail: "",
      };
    case "RunnerLoaded":
      return { label: "loaded", tone: "busy", progress: null, detail: "" };
    case "RunnerWarmingUp":
      return { label: "warming up", tone: "busy", progress: null, detail: "" };
    case "RunnerReady":
      return {
        label: "ready",
        tone: "ok",
        progress: null,
        detail: status.weight_bytes ? `${formatBytes(status.weight_bytes)} of weights` : "",
      };
    case "RunnerRunning":
      return { label: "generating", tone: "ok", progress: null, detail: "" };
    case "RunnerFailed":
      return { label: "failed", tone: "bad", progress: null, detail: status.error_message };
    case "RunnerShutdown":
      return { label: "shut down", tone: "idle", progress: null, detail: "" };
    default:
      return { label: status.kind, tone: "idle", progress: null, detail: "" };
  }
}

/** One word for a whole instance: ready when every runner is, failed when one is. */
export function instanceStatus(state, instance) {
  const runnerIds = Object.keys(instance.shard_assignments.runner_to_shard);
  const kinds = runnerIds.map((id) => state.runners[id]?.kind);
  if (state.unavailable_instances[instance.instance_id]) return "unavailable";
  if (kinds.includes("RunnerFailed")) return "failed";
  if (kinds.every((k) => k === "RunnerReady" || k === "RunnerRunning")) return "ready";
  return "loading";
}
