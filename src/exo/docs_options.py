"""The options page of the docs (`docs/options.md`), generated from the argparse parsers.

`python -m exo.docs_options > docs/options.md` writes it: every flag of `exo` (with the API
key, limit and cluster secret groups) and of `exo bench`, with its help text as `--help`
renders it and a link to the page that explains it, then the environment variables exo
reads. `src/exo/tests/test_docs_options.py` fails while the committed page differs from
this output, and when a help text is longer than `MAX_HELP_CHARACTERS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass

# A help text, as `--help` renders it (its `%(default)s` filled in), fits one line of a
# wide terminal: one sentence saying what the option does and its default.
MAX_HELP_CHARACTERS = 120
REGENERATE = "python -m exo.docs_options > docs/options.md"

# Where each flag (its argparse `dest`) is explained beyond its one-line help.
NODE_DETAILS = {
    "api_port": "troubleshooting.md#ports",
    "host": "troubleshooting.md#ports",
    "zenoh_port": "troubleshooting.md#ports",
    "namespace": "cluster.md#discovery-and-namespaces",
    "bootstrap_peers": "cluster.md#discovery-and-namespaces",
    "no_multicast": "troubleshooting.md#multicast",
    "force_master": "cluster.md#discovery-and-namespaces",
    "offline": "models.md#model-files-and-downloads",
    "no_default_model": "models.md#built-in-models-from-pypi",
    "no_auto_place": "api.md#load-on-request",
    "kv_cache_tokens": "api.md#many-users-at-once",
    "kv_cache_dtype": "engine.md#kv-cache-dtype",
    "speculative": "api.md#speculative-decoding",
    "draft_min": "api.md#speculative-decoding",
    "draft_max": "api.md#speculative-decoding",
    "draft_model": "api.md#speculative-decoding",
    "draft_on_spare": "engine.md#a-draft-model-on-another-node",
    "idle_unload": "api.md#keep-alive-and-idle-unload",
    "trust_remote_code": "models.md#custom-models",
    "max_concurrent_requests": "api.md#many-users-at-once",
    "stream_interval_ms": "api.md#streaming-interval",
    "prefill_activations": "engine.md#prefill-activations",
    "decode_activations": "engine.md#decode-activations",
    "max_queued_requests": "api.md#many-users-at-once",
    "cors_origins": "api.md#browsers",
    "model_alias": "compatibility.md#coding-agents",
    "remeasure_speed": "cluster.md#predicted-speed",
    "api_key": "security.md#api-keys",
    "api_key_file": "security.md#api-keys",
    "no_auth": "security.md#api-keys",
    "max_body_size": "security.md#limits-on-clients",
    "header_timeout": "security.md#limits-on-clients",
    "body_timeout": "security.md#limits-on-clients",
    "max_connections": "security.md#limits-on-clients",
    "max_generations_per_client": "security.md#limits-on-clients",
    "rate_limit": "security.md#limits-on-clients",
    "image_max_bytes": "api.md#images",
    "image_max_pixels": "api.md#images",
    "image_fetch_timeout": "api.md#images",
    "image_allow_private_urls": "api.md#images",
    "cluster_secret": "security.md#cluster-secret",
    "cluster_secret_file": "security.md#cluster-secret",
}
BENCH_DETAILS = {
    "suite": "benchmarks/index.md#the-speed-targets-suite",
    "model": "benchmarks/index.md#nodes",
    "model_dir": "benchmarks/index.md#nodes",
    "placement": "benchmarks/index.md#nodes",
    "prompt_tokens": "benchmarks/index.md#what-a-run-is",
    "generation_tokens": "benchmarks/index.md#what-a-run-is",
    "concurrency": "benchmarks/index.md#what-a-run-is",
    "runs": "benchmarks/index.md#what-a-run-is",
    "warmup": "benchmarks/index.md#what-a-run-is",
    "settle_seconds": "benchmarks/index.md#what-a-run-is",
    "api": "benchmarks/index.md#nodes",
    "api_key": "benchmarks/index.md#nodes",
    "nodes": "benchmarks/index.md#nodes",
    "pin_cores": "benchmarks/index.md#pinned-cores",
    "threads": "benchmarks/index.md#comparing-with-llamacpp",
    "prefill_activations": "engine.md#prefill-activations",
    "compare_llama_cpp": "benchmarks/index.md#comparing-with-llamacpp",
    "engine_in_process": "benchmarks/index.md#comparing-with-llamacpp",
    "sequential_placements": "benchmarks/index.md#nodes",
    "output": "benchmarks/index.md#output",
    "name": "benchmarks/index.md#output",
    "no_plots": "benchmarks/index.md#output",
    "quick": "benchmarks/index.md#what-a-run-is",
}


@dataclass(frozen=True, slots=True)
class EnvironmentVariable:
    name: str
    what: str
    details: str  # a page of the docs, with its anchor


ENVIRONMENT = (
    EnvironmentVariable(
        "EXO_HOME",
        "the node's data directory; one node per directory (default `$XDG_DATA_HOME/exo`, "
        "i.e. `~/.local/share/exo`)",
        "cluster.md#history-on-disk",
    ),
    EnvironmentVariable(
        "EXO_MODELS_DIR",
        "where converted and downloaded models live (default `$EXO_HOME/models`)",
        "models.md#model-files-and-downloads",
    ),
    EnvironmentVariable(
        "EXO_MODELS_DIRS",
        "`:`-separated writable models directories searched and written (default `EXO_MODELS_DIR`)",
        "models.md#model-files-and-downloads",
    ),
    EnvironmentVariable(
        "EXO_MODELS_READ_ONLY_DIRS",
        "`:`-separated models directories searched, never written",
        "models.md#model-files-and-downloads",
    ),
    EnvironmentVariable("EXO_NAMESPACE", "as `--namespace`", "cluster.md#discovery-and-namespaces"),
    EnvironmentVariable("EXO_OFFLINE", "`1` as `--offline`", "models.md#model-files-and-downloads"),
    EnvironmentVariable("EXO_API_KEY", "one more API key, as `--api-key`", "security.md#api-keys"),
    EnvironmentVariable("EXO_CORS_ORIGINS", "as `--cors-origins`", "api.md#browsers"),
    EnvironmentVariable(
        "EXO_MODEL_ALIASES",
        "as `--model-alias`, comma-separated",
        "compatibility.md#coding-agents",
    ),
    EnvironmentVariable(
        "EXO_CLUSTER_SECRET",
        "the cluster secret, as `--cluster-secret`",
        "security.md#cluster-secret",
    ),
    EnvironmentVariable(
        "EXO_SPEED_PROBE",
        "`0`: the node does not measure its speed (reports none; previews predict nothing)",
        "cluster.md#predicted-speed",
    ),
    EnvironmentVariable(
        "EXO_SPEED_PROBE_CACHE",
        "file of the node's measured speed (default `$EXO_HOME/speed_probe.json`)",
        "cluster.md#predicted-speed",
    ),
    EnvironmentVariable(
        "EXO_RANK_LINKS",
        "`0` forms a gloo group for split instances on CPU and keeps every message on it, "
        "instead of exo's rank links alone",
        "cluster.md#rank-links",
    ),
    EnvironmentVariable(
        "EXO_LINK_SPIN_US",
        "microseconds a rank polls its link before sleeping (default 1000; 0: never)",
        "cluster.md#rank-links",
    ),
    EnvironmentVariable(
        "EXO_LEAN_FORWARD",
        "`0` runs transformers' forward instead of the engine's own",
        "engine.md#the-engines-own-forward",
    ),
    EnvironmentVariable(
        "EXO_LEAN_BF16",
        "`0` / `1` forces float32 / bfloat16 activations between the int4 kernels",
        "engine.md#the-engines-own-forward",
    ),
    EnvironmentVariable(
        "EXO_NATIVE_INT4", "`1` / `0` forces exo's CPU kernels on / off", "engine.md#exos-kernels"
    ),
    EnvironmentVariable(
        "EXO_NATIVE_INT_GEMM",
        "`0`: float32 prefill; `1`: the integer GEMM; `256`: with 256-bit tiles",
        "engine.md#exos-kernels",
    ),
    EnvironmentVariable(
        "EXO_NATIVE_AVX512",
        "`0` runs the 256-bit (AVX2) int4 decode kernel where the 512-bit one is built",
        "engine.md#exos-kernels",
    ),
    EnvironmentVariable(
        "EXO_Q4K_COMPACT",
        "`1` holds GGUF Q4_K weights' scales compact (4.625 bits, decode unrounded), not as "
        "bfloat16 pairs",
        "engine.md#exos-kernels",
    ),
    EnvironmentVariable(
        "EXO_Q6K_HEAD",
        "`0` requantizes a GGUF's Q6_K LM head to int8 per row instead of holding its blocks",
        "engine.md#exos-kernels",
    ),
    EnvironmentVariable(
        "EXO_DECODE_GEMM_MIN_ROWS",
        "rows of a decode step from which block weights take the integer GEMM",
        "engine.md#exos-kernels",
    ),
    EnvironmentVariable(
        "EXO_NATIVE_DECODE",
        "`0` runs a decode step's layers as torch operators, not one C++ call",
        "engine.md#exos-kernels",
    ),
    EnvironmentVariable(
        "EXO_HUGE_PAGES",
        "`0` keeps runners off transparent huge pages where the kernel gives them when asked",
        "engine.md#huge-pages",
    ),
    EnvironmentVariable(
        "EXO_DRAFT_AHEAD",
        "`0`: a draft server no longer drafts ahead while the target verifies",
        "engine.md#drafting-ahead",
    ),
    EnvironmentVariable(
        "EXO_KV_CACHE_DTYPE",
        "`float32` / `bfloat16`: the KV dtype of engines started without `--kv-cache-dtype` "
        "(tests comparing with transformers use `float32`)",
        "engine.md#kv-cache-dtype",
    ),
    EnvironmentVariable(
        "EXO_TRACEMALLOC",
        "a directory: the node traces its Python allocations and writes a snapshot there on "
        "`SIGUSR2` (a test node's; off by default)",
        "testing.md#node-memory",
    ),
    EnvironmentVariable(
        "EXO_TRACEMALLOC_FRAMES",
        "frames kept per traced allocation (default 16)",
        "testing.md#node-memory",
    ),
    EnvironmentVariable(
        "EXO_TRACEMALLOC_HOLDERS",
        "comma-separated `module.Class` names: each snapshot also writes what holds their "
        "newest instances",
        "testing.md#node-memory",
    ),
    EnvironmentVariable(
        "OVERRIDE_MEMORY_MB",
        "memory this node reports as available, less what its runners hold",
        "troubleshooting.md#memory",
    ),
    EnvironmentVariable(
        "HF_ENDPOINT", "Hugging Face Hub mirror", "models.md#model-files-and-downloads"
    ),
    EnvironmentVariable(
        "HF_TOKEN",
        "Hugging Face token, for gated and private models",
        "models.md#model-files-and-downloads",
    ),
    EnvironmentVariable(
        "HF_HUB_CACHE",
        "the Hugging Face cache searched for models (default `$HF_HOME/hub`)",
        "models.md#model-files-and-downloads",
    ),
    EnvironmentVariable(
        "HF_HOME",
        "Hugging Face's directory (default `~/.cache/huggingface`)",
        "models.md#model-files-and-downloads",
    ),
    EnvironmentVariable(
        "HTTPS_PROXY", "proxy for Hub downloads", "models.md#model-files-and-downloads"
    ),
    EnvironmentVariable(
        "OLLAMA_MODELS",
        "Ollama's model store, whose models join the node's (default `~/.ollama/models`, else the "
        "Linux service's `/usr/share/ollama/.ollama/models`)",
        "models.md#ollamas-store",
    ),
    EnvironmentVariable(
        "TORCH_EXTENSIONS_DIR",
        "where exo's kernels are built (default `~/.cache/torch_extensions`)",
        "engine.md#building-the-kernels",
    ),
    EnvironmentVariable(
        "OMP_NUM_THREADS",
        "threads of each runner (default: the CPUs the node may run on)",
        "engine.md#threads",
    ),
    EnvironmentVariable(
        "EXO_RUNNER_START",
        "`spawn` starts each runner as a fresh interpreter, not forked from the node's "
        "runner server",
        "engine.md#runner-start-up",
    ),
    EnvironmentVariable(
        "GOMP_SPINCOUNT",
        "libgomp's spin before an idle thread sleeps (default: exo's choice per CPU vendor)",
        "engine.md#threads",
    ),
    EnvironmentVariable(
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
        "oneDNN's per-shape kernel cache in runners (default 64)",
        "testing.md#soak",
    ),
    EnvironmentVariable(
        "LRU_CACHE_CAPACITY", "ideep's per-shape cache in runners (default 64)", "testing.md#soak"
    ),
    EnvironmentVariable(
        "GLOO_SOCKET_IFNAME",
        "the interface gloo uses (default: the one that reaches rank 0)",
        "troubleshooting.md#firewalls",
    ),
    EnvironmentVariable(
        "XDG_CACHE_HOME",
        "`exo bench`'s random models live in `$XDG_CACHE_HOME/exo-bench` (default `~/.cache`)",
        "benchmarks/index.md#the-speed-targets-suite",
    ),
)


@dataclass(frozen=True, slots=True)
class OptionHelp:
    """One flag as `--help` shows it."""

    group: str
    dest: str
    invocation: str  # "--idle-unload SECONDS"
    help: str  # the help text with its `%(default)s` filled in


def option_helps(parser: argparse.ArgumentParser) -> Iterator[OptionHelp]:
    """Every optional argument of `parser` by argument group, in `--help`'s order."""
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            yield OptionHelp(
                group=group.title or "",
                dest=action.dest,
                invocation=formatter._format_action_invocation(action),
                help=formatter._expand_help(action) if action.help else "",
            )


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    from exo.benchmark.cli import build_parser as build_bench_parser
    from exo.node_options import build_parser as build_node_parser

    return build_node_parser(), build_bench_parser()


def all_option_helps() -> list[OptionHelp]:
    """The flags of `exo` and `exo bench`."""
    node, bench = _parsers()
    return [*option_helps(node), *option_helps(bench)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(options: list[OptionHelp], details: dict[str, str]) -> list[str]:
    lines = ["| option | what it does | more |", "|---|---|---|"]
    for option in options:
        link = details.get(option.dest)
        more = f"[details]({link})" if link else ""
        lines.append(f"| `{_cell(option.invocation)}` | {_cell(option.help)} | {more} |")
    return lines


def _grouped(options: list[OptionHelp]) -> dict[str, list[OptionHelp]]:
    groups: dict[str, list[OptionHelp]] = {}
    for option in options:
        groups.setdefault(option.group, []).append(option)
    return groups


def render() -> str:
    """The options page, Markdown."""
    node, bench = _parsers()
    lines = [
        "# Options",
        "",
        "<!-- Generated from exo's argparse parsers: do not edit. Change the help texts in the",
        f"code (or the links in src/exo/docs_options.py), then run `{REGENERATE}`. -->",
        "",
        "Every flag of `exo` and `exo bench`, with the one-line help that `--help` prints, and",
        "the environment variables exo reads. The page behind each *details* link explains the",
        "option at length.",
        "",
        "## exo",
        "",
        "`exo [options]` runs a node; Ctrl-C stops it and every runner it started.",
    ]
    for group, options in _grouped(list(option_helps(node))).items():
        title = "Node" if group == "options" else group[0].upper() + group[1:]
        lines += ["", f"### {title}", "", *_table(options, NODE_DETAILS)]
    lines += [
        "",
        "## exo bench",
        "",
        "`exo bench [options]` measures placements through a node's API; see",
        "[Benchmarks](benchmarks/index.md).",
        "",
        *_table(list(option_helps(bench)), BENCH_DETAILS),
        "",
        "## Environment variables",
        "",
        "| variable | what it does | more |",
        "|---|---|---|",
    ]
    for variable in ENVIRONMENT:
        lines.append(
            f"| `{variable.name}` | {_cell(variable.what)} | [details]({variable.details}) |"
        )
    lines += [
        "",
        "The test suite reads a few more (`EXO_FUZZ_BODIES`, `EXO_FUZZ_SCHEMA_EXAMPLES`): see",
        "[Testing](testing.md#fuzz).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
