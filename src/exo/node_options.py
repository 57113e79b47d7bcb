"""`exo`'s command line: the node's flags (`parse_args`) and the `Options` they give."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from dataclasses import dataclass, field

from exo.api.guards.browser_access import parse_cors_origins
from exo.api.security import (
    SecurityOptions,
    add_security_arguments,
    security_options,
)
from exo.api.serving.model_aliases import ModelAlias, parse_model_aliases
from exo.api.wire.images import ImagePolicy, add_image_arguments, image_policy_from_args
from exo.routing.cluster_tls import ClusterSecret
from exo.routing.secret_options import (
    add_cluster_secret_arguments,
    bootstrap_peer_problem,
    cluster_secret_option,
)
from exo.routing.zenoh_router import DEFAULT_ZENOH_PORT, check_key_chunk
from exo.shared.constants import (
    DEFAULT_API_PORT,
    PROTOCOL_VERSION,
)
from exo.shared.models.drafts import draft_option_problem
from exo.shared.models.kv_cache_memory import (
    DEFAULT_KV_CACHE_DTYPE,
    KV_CACHE_DTYPES,
    MIN_KV_CACHE_TOKENS,
    KVCacheDtype,
)
from exo.shared.models.weight_formats import (
    DECODE_ACTIVATIONS,
    DEFAULT_DECODE_ACTIVATIONS,
    DEFAULT_PREFILL_ACTIVATIONS,
    PREFILL_ACTIVATIONS,
    DecodeActivations,
    PrefillActivations,
    default_prefill_activations,
)
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    DEFAULT_DRAFT_MAX,
    DEFAULT_DRAFT_MIN,
    SpeculativeMode,
)

DEFAULT_MODEL_ID = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
# `--speculative`'s choices and the mode each sets (`TextGenerationTaskParams.speculative`).
SPECULATIVE_CHOICES: dict[str, SpeculativeMode] = {"auto": "auto", "on": True, "off": False}
# `--stream-interval-ms`: 30 ms (two frames of a 60 Hz screen) groups four or five tokens of
# a ~150 tok/s decode and none of a decode slower than ~33 tok/s. Measured on the 2-core
# reference machine (SmolLM2-135M, 190 tok/s, the runner's step period over 1,300 tokens
# streamed through the API against the engine's own step in-process): 0.97 of the engine's
# rate at 30 ms, 0.91-0.96 at 15 ms; each chunk costs the node ~0.7 ms of CPU on the cores
# that decode.
DEFAULT_STREAM_INTERVAL_MS = 30.0
MAX_STREAM_INTERVAL_MS = 1000.0


@dataclass(frozen=True)
class Options:
    host: str
    api_port: int
    zenoh_port: int
    namespace: str
    bootstrap_peers: tuple[str, ...]
    multicast: bool
    force_master: bool
    log_level: str
    offline: bool
    default_model: bool
    cors_origins: tuple[str, ...] = ()
    # Client model names served by other models (`--model-alias`).
    model_aliases: tuple[ModelAlias, ...] = ()
    auto_place: bool = True
    idle_unload_seconds: float | None = None
    trust_remote_code: bool = False
    security: SecurityOptions = field(default_factory=SecurityOptions)
    max_queued_requests: int | None = None
    max_concurrent_requests: int | None = None
    # Seconds a runner holds a stream's tokens to send them together (`--stream-interval-ms`).
    stream_interval_seconds: float = DEFAULT_STREAM_INTERVAL_MS / 1000
    remeasure_speed: bool = False
    cluster_secret: ClusterSecret | None = None
    # How prefill rounds int4 / 5-bit block weights' activations (`--prefill-activations`).
    prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS
    # How int4 weights' products round activations (`--decode-activations`).
    decode_activations: DecodeActivations = DEFAULT_DECODE_ACTIVATIONS
    # Each runner's KV-cache budget in tokens (`--kv-cache-tokens`).
    kv_cache_tokens: int | None = None
    # How runners store keys and values on CPU (`--kv-cache-dtype`).
    kv_cache_dtype: KVCacheDtype | None = None
    # Speculative decoding for requests that do not say, and its draft length's bounds
    # (`--speculative`, `--draft-min`, `--draft-max`).
    speculative: SpeculativeMode = "auto"
    draft_min: int = DEFAULT_DRAFT_MIN
    draft_max: int = DEFAULT_DRAFT_MAX
    # The draft model of speculative decoding (`--draft-model`; None: the card's, else n-gram).
    draft_model: str | None = None
    # Whether placement may run this node's instances' draft models on a spare node
    # (`--draft-on-spare` / `--no-draft-on-spare`).
    draft_on_spare: bool = True
    # Limits on image input and image URL fetching (`--image-*`).
    image_policy: ImagePolicy = field(default_factory=ImagePolicy)


def package_version() -> str:
    """The installed `exo` distribution's version (`exo --version`), from its metadata; a
    source tree run without installing has none."""
    try:
        return importlib.metadata.version("exo")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown: the exo package is not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The node's argument parser (also read by `exo.docs_options` for the options page).

    Each help text is one sentence of at most 120 characters with its default; the details
    are in docs/options.md and the pages it links to.
    """
    parser = argparse.ArgumentParser(
        prog="exo",
        description=(
            "Run an exo node (`exo bench --help`: measure placements). Nodes on the same "
            "network find each other, form one cluster and serve its models through the "
            "OpenAI Chat Completions, Responses, Claude Messages and Ollama APIs and a "
            f"dashboard on port {DEFAULT_API_PORT} of every node. The node keeps its keys, "
            "history and models in $EXO_HOME (default ~/.local/share/exo)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "--api-port",
        type=int,
        default=DEFAULT_API_PORT,
        help="port of the HTTP API and the dashboard (default %(default)s)",
    )
    parser.add_argument(
        "--host",
        "--api-host",
        dest="host",
        default="0.0.0.0",
        help="address the API and the cluster links listen on (default %(default)s: all)",
    )
    parser.add_argument(
        "--zenoh-port",
        type=int,
        default=DEFAULT_ZENOH_PORT,
        help="TCP port of the links between nodes (default %(default)s)",
    )
    parser.add_argument(
        "--namespace",
        default=os.environ.get("EXO_NAMESPACE") or PROTOCOL_VERSION,
        help="cluster name: nodes join only nodes with the same one (default: exo's protocol "
        "version; env EXO_NAMESPACE)",
    )
    parser.add_argument(
        "--bootstrap-peers",
        default="",
        help="comma-separated peers to link to where multicast does not reach, e.g. "
        "tcp/192.168.1.7:52414 (default: none)",
    )
    parser.add_argument(
        "--no-multicast",
        action="store_true",
        help="do not look for peers by multicast, only --bootstrap-peers (default: look)",
    )
    parser.add_argument(
        "--force-master",
        action="store_true",
        help="win every master election (default: the sitting master stays, then the node with "
        "the most history)",
    )
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument(
        "-v", "--verbose", action="count", default=0, help="log debug messages too (default: info)"
    )
    verbosity.add_argument(
        "-q", "--quiet", action="store_true", help="log warnings and errors only (default: info)"
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        default=os.environ.get("EXO_OFFLINE", "").strip().lower() not in ("", "0", "false", "no"),
        help="never download: use only models already on this machine (default: download; "
        "env EXO_OFFLINE=1)",
    )
    parser.add_argument(
        "--no-default-model",
        action="store_true",
        help=f"do not place {DEFAULT_MODEL_ID} on a cluster with no instance (default: place it)",
    )
    parser.add_argument(
        "--no-auto-place",
        action="store_true",
        help="answer 404 to a request for a model with no instance (default: place the model "
        "and wait for it)",
    )
    parser.add_argument(
        "--idle-unload",
        type=float,
        default=None,
        metavar="SECONDS",
        help="unload (delete) instances this node places or serves once idle this long (default: "
        "keep them)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let POST /models/add accept repositories whose config names custom code "
        "(default: refuse them)",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests each runner of this node decodes together in one batch (default 8 on CPU)",
    )
    parser.add_argument(
        "--stream-interval-ms",
        type=float,
        default=DEFAULT_STREAM_INTERVAL_MS,
        metavar="MS",
        help="send each stream's tokens to the API at most every MS milliseconds, 0 to "
        f"{MAX_STREAM_INTERVAL_MS:g} (default {DEFAULT_STREAM_INTERVAL_MS:g}; 0: every token "
        "at once)",
    )
    parser.add_argument(
        "--prefill-activations",
        choices=PREFILL_ACTIVATIONS,
        default=default_prefill_activations(),
        help="how runners round a prompt's activations for quantized weights on AVX2 CPUs "
        "(default: bf16 with AMX-BF16, else int16)",
    )
    parser.add_argument(
        "--decode-activations",
        choices=DECODE_ACTIVATIONS,
        default=DEFAULT_DECODE_ACTIVATIONS,
        help="how runners round int4 weights' activations on AVX2 CPUs (int8: llama.cpp's, "
        "faster, less exact; default: int16)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        metavar="N",
        help="KV-cache tokens each runner keeps room for, all its requests together "
        "(default: sized from free memory)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="how runners store keys and values (default: "
        f"{DEFAULT_KV_CACHE_DTYPE} on CPU, the model's dtype elsewhere)",
    )
    parser.add_argument(
        "--speculative",
        choices=tuple(SPECULATIVE_CHOICES),
        default="auto",
        help="speculative decoding for requests that do not say: on, off, or where "
        "measured to help (default: auto)",
    )
    parser.add_argument(
        "--draft-min",
        type=int,
        default=DEFAULT_DRAFT_MIN,
        metavar="N",
        help=f"shortest draft verified, in tokens (default: {DEFAULT_DRAFT_MIN})",
    )
    parser.add_argument(
        "--draft-max",
        type=int,
        default=DEFAULT_DRAFT_MAX,
        metavar="N",
        help="longest draft per request and step, in tokens; the length adapts between the "
        f"two (default: {DEFAULT_DRAFT_MAX})",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        metavar="MODEL",
        help="speculative draft model here, overriding cards' (not for itself or another "
        "vocabulary; default: the card's, else n-gram)",
    )
    parser.add_argument(
        "--draft-on-spare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the draft model of instances whose rank 0 is here on a spare node when "
        "one has room (default: on)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests this node's API lets each instance queue beyond its batch (default: 4 "
        "batches, at least 16)",
    )
    parser.add_argument(
        "--cors-origins",
        default=os.environ.get("EXO_CORS_ORIGINS", ""),
        help="comma-separated web origins allowed to use the API besides local pages "
        "(default: none; env EXO_CORS_ORIGINS)",
    )
    parser.add_argument(
        "--model-alias",
        action="append",
        default=[a for a in [os.environ.get("EXO_MODEL_ALIASES", "")] if a],
        metavar="PATTERN=MODEL",
        help="serve client model names matching PATTERN (* wildcards) with MODEL, repeatable "
        "(default: none; env EXO_MODEL_ALIASES)",
    )
    parser.add_argument(
        "--remeasure-speed",
        action="store_true",
        help="measure this node's speed again instead of reading the cached figures "
        "(default: use the cache)",
    )
    add_security_arguments(parser)
    add_image_arguments(parser)
    add_cluster_secret_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> Options:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, port in (("--api-port", args.api_port), ("--zenoh-port", args.zenoh_port)):
        if not 0 < port < 65536:
            parser.error(f"{flag} must be between 1 and 65535, not {port}")
    if args.api_port == args.zenoh_port:
        parser.error("--api-port and --zenoh-port must differ")
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        parser.error(f"--max-concurrent-requests must be >= 1, not {args.max_concurrent_requests}")
    if not 0 <= args.stream_interval_ms <= MAX_STREAM_INTERVAL_MS:
        parser.error(
            f"--stream-interval-ms must be between 0 and {MAX_STREAM_INTERVAL_MS:g}, "
            f"not {args.stream_interval_ms:g}"
        )
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < MIN_KV_CACHE_TOKENS:
        parser.error(
            f"--kv-cache-tokens must be >= {MIN_KV_CACHE_TOKENS}, not {args.kv_cache_tokens}"
        )
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        parser.error(f"--max-queued-requests must be >= 0, not {args.max_queued_requests}")
    if not 1 <= args.draft_min <= args.draft_max:
        parser.error(
            f"--draft-min and --draft-max need 1 <= min <= max, not {args.draft_min} and "
            f"{args.draft_max}"
        )
    if args.draft_model is not None and (problem := draft_option_problem(args.draft_model)):
        parser.error(problem)
    if args.idle_unload is not None and not 0 <= args.idle_unload < float("inf"):
        parser.error(f"--idle-unload must be a number of seconds >= 0, not {args.idle_unload}")
    try:
        check_key_chunk("namespace", args.namespace)
    except ValueError as error:
        parser.error(f"--namespace (or EXO_NAMESPACE): {error}")
    peers = tuple(p.strip() for p in args.bootstrap_peers.split(",") if p.strip())
    for peer in peers:
        if (problem := bootstrap_peer_problem(peer)) is not None:
            parser.error(problem)
    try:
        cors_origins = parse_cors_origins(args.cors_origins)
    except ValueError as error:
        parser.error(f"--cors-origins: {error}")
    try:
        model_aliases = parse_model_aliases(args.model_alias)
    except ValueError as error:
        parser.error(f"--model-alias: {error}")
    log_level = "WARNING" if args.quiet else ("DEBUG" if args.verbose else "INFO")
    return Options(
        host=args.host,
        api_port=args.api_port,
        zenoh_port=args.zenoh_port,
        namespace=args.namespace,
        bootstrap_peers=peers,
        multicast=not args.no_multicast,
        force_master=args.force_master,
        log_level=log_level,
        offline=args.offline,
        default_model=not args.no_default_model,
        cors_origins=cors_origins,
        model_aliases=model_aliases,
        auto_place=not args.no_auto_place,
        idle_unload_seconds=args.idle_unload,
        trust_remote_code=args.trust_remote_code,
        security=security_options(args, parser),
        image_policy=image_policy_from_args(args, parser),
        max_queued_requests=args.max_queued_requests,
        max_concurrent_requests=args.max_concurrent_requests,
        stream_interval_seconds=args.stream_interval_ms / 1000,
        prefill_activations=args.prefill_activations,
        decode_activations=args.decode_activations,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative=SPECULATIVE_CHOICES[args.speculative],
        draft_min=args.draft_min,
        draft_max=args.draft_max,
        draft_model=args.draft_model,
        draft_on_spare=args.draft_on_spare,
        remeasure_speed=args.remeasure_speed,
        cluster_secret=cluster_secret_option(args, parser, peers),
    )
