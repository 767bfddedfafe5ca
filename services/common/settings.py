"""Service settings: dataclasses with defaults, filled from command-line flags whose defaults come from
the environment (flag > env > default). Every flag's environment variable is in `--help`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

MiB = 1024 * 1024
RECOVERY_MODES = ("colocated", "disaggregated")


@dataclass
class StoreSettings:
    redis_url: str | None = None          # None: the in-process store (one process only)
    prefix: str = "raincheck:"
    session_ttl_s: float = 86400.0        # a session record expires this long after its last turn


@dataclass
class FrontendSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    api_keys: tuple[str, ...] = ()        # none: no authentication (loopback only, or allow_no_auth)
    allow_no_auth: bool = False
    tls_cert: str | None = None           # PEM files; both or neither
    tls_key: str | None = None
    max_image_bytes: int = 10 * MiB
    max_images: int = 16                  # images per message
    max_video_frames: int = 64            # frames per message, over all videos
    max_message_bytes: int = 64 * MiB
    worker_timeout_s: float = 30.0        # unary calls to decode workers
    threads: int = 64                     # concurrent RPCs (each streaming turn holds one)
    default_recovery_mode: str = "colocated"   # for sessions that do not ask for one
    metrics_port: int | None = 9464       # None: no /metrics
    metrics_host: str = "127.0.0.1"
    drain_s: float = 5.0                  # on shutdown, running turns get this long to finish
    store: StoreSettings = field(default_factory=StoreSettings)


@dataclass
class ModelSpec:
    """What an Engine loads. A decode worker and its deferred workers must load the same weights."""

    model: str | None = None              # checkpoint folder; None: the seeded random model
    name: str | None = None               # the name clients ask for (default: the folder's name)
    random_size: str = "tiny"             # size of the random model: tiny | bench
    device: str = "cpu"
    dtype: str = "float32"
    engine: dict = field(default_factory=dict)   # EngineConfig options (num_pages, page_size, ...)


@dataclass
class DeferredSettings:
    """Ray deferred workers, for `disaggregated` recovery (docs/services.md, Recovery modes)."""

    ray_address: str | None = None        # a cluster (host:port, `ray://` for Ray Client); None: a local Ray
    namespace: str = "raincheck"          # where deferred-worker actors are registered by name
    workers: int = 1                      # actors of its own to start when none is registered
    num_cpus: float = 1.0                 # what each actor asks Ray for
    num_gpus: float = 0.0
    resource: str = "raincheck_deferred"  # custom resource each actor asks one unit of ("": none)
    timeout_s: float = 120.0              # answer end -> result joined; past it, the decode worker finishes


@dataclass
class WorkerSettings:
    model: str | None = None              # checkpoint folder; None: a random model (noise answers)
    model_name: str | None = None         # the name clients ask for (default: the folder's name)
    random_size: str = "tiny"             # size of the random model without --model: tiny | bench
    device: str = "cpu"
    dtype: str = "float32"
    engine: dict = field(default_factory=dict)   # EngineConfig options (num_pages, page_size, ...)
    host: str = "127.0.0.1"
    port: int = 50061
    advertise: str | None = None          # host:port frontends dial (default host:bound port)
    worker_id: str | None = None
    default_policy: str = "raincheck"
    max_new_tokens: int = 256             # when a request does not say
    heartbeat_s: float = 2.0
    registration_ttl_s: float = 10.0
    session_idle_s: float = 3600.0        # close sessions idle this long
    threads: int = 64
    max_message_bytes: int = 256 * MiB    # rebuilds carry a session's whole history
    metrics_port: int | None = 9465
    metrics_host: str = "127.0.0.1"
    drain_s: float = 5.0
    recovery_modes: tuple[str, ...] = ("colocated",)
    deferred: DeferredSettings = field(default_factory=DeferredSettings)
    store: StoreSettings = field(default_factory=StoreSettings)

    def model_spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.model_name, self.random_size, self.device, self.dtype, self.engine)


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def add_store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=_env("REDIS_URL"), help="Redis for shared state [REDIS_URL]; "
                   "without it an in-process store serves this process only")
    p.add_argument("--store-prefix", default=_env("RAINCHECK_STORE_PREFIX", "raincheck:"),
                   help="Redis key prefix [RAINCHECK_STORE_PREFIX]")


def add_frontend_flags(p: argparse.ArgumentParser, port: int = 50051) -> None:
    p.add_argument("--host", default=_env("RAINCHECK_HOST", "127.0.0.1"), help="[RAINCHECK_HOST]")
    p.add_argument("--port", type=int, default=int(_env("RAINCHECK_PORT", str(port))), help="[RAINCHECK_PORT]")
    p.add_argument("--api-keys", default=_env("RAINCHECK_API_KEYS", ""),
                   help="comma-separated API keys [RAINCHECK_API_KEYS]")
    p.add_argument("--api-keys-file", default=_env("RAINCHECK_API_KEYS_FILE"),
                   help="file with one API key per line [RAINCHECK_API_KEYS_FILE]")
    p.add_argument("--insecure-allow-no-auth", action="store_true",
                   help="serve without API keys on a non-loopback address")
    p.add_argument("--tls-cert", default=_env("RAINCHECK_TLS_CERT"), help="PEM certificate [RAINCHECK_TLS_CERT]")
    p.add_argument("--tls-key", default=_env("RAINCHECK_TLS_KEY"), help="PEM private key [RAINCHECK_TLS_KEY]")
    p.add_argument("--max-image-bytes", type=int, default=10 * MiB)
    p.add_argument("--recovery-mode", choices=RECOVERY_MODES,
                   default=_env("RAINCHECK_RECOVERY_MODE", "colocated"),
                   help="recovery mode of sessions that do not ask for one [RAINCHECK_RECOVERY_MODE]")
    _add_process_flags(p, 9464)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_env("RAINCHECK_MODEL"),
                   help="checkpoint folder [RAINCHECK_MODEL]; default: a random model (noise answers)")
    p.add_argument("--model-name", default=_env("RAINCHECK_MODEL_NAME"), help="[RAINCHECK_MODEL_NAME]")
    p.add_argument("--random-size", choices=["tiny", "bench"], default="tiny",
                   help="size of the random model used without --model")
    p.add_argument("--device", default=_env("RAINCHECK_DEVICE", "cpu"), help="[RAINCHECK_DEVICE]")
    p.add_argument("--dtype", default=_env("RAINCHECK_DTYPE", "float32"), help="[RAINCHECK_DTYPE]")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages in the pool")


def add_ray_flags(p: argparse.ArgumentParser, workers: int, workers_help: str) -> None:
    """Where the deferred workers live and what each asks Ray for."""
    p.add_argument("--ray-address", default=_env("RAY_ADDRESS"),
                   help="Ray cluster of the deferred workers (host:port, or ray://host:10001 for Ray Client) "
                        "[RAY_ADDRESS]; empty: start a local Ray in this process")
    p.add_argument("--ray-namespace", default=_env("RAINCHECK_RAY_NAMESPACE", "raincheck"),
                   help="Ray namespace of the deferred-worker actors [RAINCHECK_RAY_NAMESPACE]")
    p.add_argument("--deferred-workers", type=int, default=int(_env("RAINCHECK_DEFERRED_WORKERS", str(workers))),
                   help=f"{workers_help} [RAINCHECK_DEFERRED_WORKERS]")
    p.add_argument("--deferred-num-cpus", type=float, default=float(_env("RAINCHECK_DEFERRED_NUM_CPUS", "1")),
                   help="CPUs each deferred-worker actor asks Ray for [RAINCHECK_DEFERRED_NUM_CPUS]")
    p.add_argument("--deferred-num-gpus", type=float, default=float(_env("RAINCHECK_DEFERRED_NUM_GPUS", "0")),
                   help="GPUs each deferred-worker actor asks Ray for (needed for --device cuda) "
                        "[RAINCHECK_DEFERRED_NUM_GPUS]")
    p.add_argument("--deferred-resource", default=_env("RAINCHECK_DEFERRED_RESOURCE", "raincheck_deferred"),
                   help="custom Ray resource each actor asks one unit of; empty: none "
                        "[RAINCHECK_DEFERRED_RESOURCE]")


def add_worker_flags(p: argparse.ArgumentParser, *, network: bool = True) -> None:
    add_model_flags(p)
    p.add_argument("--policy", default=_env("RAINCHECK_POLICY", "raincheck"),
                   help="default deferral policy of new sessions [RAINCHECK_POLICY]")
    p.add_argument("--max-new-tokens", type=int, default=256, help="default answer length limit")
    p.add_argument("--recovery-modes", type=_modes, default=_env("RAINCHECK_RECOVERY_MODES", "colocated"),
                   help="comma-separated recovery modes offered: colocated, disaggregated "
                        "[RAINCHECK_RECOVERY_MODES]")
    p.add_argument("--deferred-timeout-s", type=float, default=float(_env("RAINCHECK_DEFERRED_TIMEOUT_S", "120")),
                   help="seconds from an answer's end until a deferred worker's result is given up on and "
                        "the recovery finished locally [RAINCHECK_DEFERRED_TIMEOUT_S]")
    if network:
        add_ray_flags(p, 1, "actors this worker starts for itself when none is registered in the namespace")
        p.add_argument("--host", default=_env("RAINCHECK_WORKER_HOST", "127.0.0.1"), help="[RAINCHECK_WORKER_HOST]")
        p.add_argument("--port", type=int, default=int(_env("RAINCHECK_WORKER_PORT", "50061")),
                       help="[RAINCHECK_WORKER_PORT]")
        p.add_argument("--advertise", default=_env("RAINCHECK_ADVERTISE"),
                       help="host:port frontends dial [RAINCHECK_ADVERTISE]")
        p.add_argument("--worker-id", default=_env("RAINCHECK_WORKER_ID"), help="[RAINCHECK_WORKER_ID]")
        _add_process_flags(p, 9465)
    else:
        add_ray_flags(p, 0, "N > 0: start a local Ray with N deferred-worker actors and offer disaggregated "
                            "recovery too")


def _modes(value: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
    unknown = set(modes) - set(RECOVERY_MODES)
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"recovery modes are {', '.join(RECOVERY_MODES)}; got {value!r}")
    return modes


def _add_process_flags(p: argparse.ArgumentParser, metrics_port: int) -> None:
    p.add_argument("--metrics-port", type=int, default=int(_env("RAINCHECK_METRICS_PORT", str(metrics_port))),
                   help="Prometheus /metrics port [RAINCHECK_METRICS_PORT]; -1 disables")
    p.add_argument("--metrics-host", default=_env("RAINCHECK_METRICS_HOST", "127.0.0.1"),
                   help="address /metrics listens on [RAINCHECK_METRICS_HOST]")
    p.add_argument("--drain-timeout-s", type=float, default=float(_env("RAINCHECK_DRAIN_TIMEOUT_S", "5")),
                   help="on SIGTERM, seconds running turns get to finish [RAINCHECK_DRAIN_TIMEOUT_S]")


def store_settings(args: argparse.Namespace) -> StoreSettings:
    return StoreSettings(redis_url=args.redis_url or None, prefix=args.store_prefix)


def _process(args: argparse.Namespace) -> dict:
    return dict(metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                metrics_host=args.metrics_host, drain_s=args.drain_timeout_s)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = [k.strip() for k in args.api_keys.split(",")]
    if args.api_keys_file:
        keys += [line.strip() for line in Path(args.api_keys_file).read_text().splitlines()]
    return tuple(k for k in keys if k)


def frontend_settings(args: argparse.Namespace) -> FrontendSettings:
    return FrontendSettings(
        host=args.host, port=args.port, api_keys=_api_keys(args), allow_no_auth=args.insecure_allow_no_auth,
        tls_cert=args.tls_cert, tls_key=args.tls_key, max_image_bytes=args.max_image_bytes,
        default_recovery_mode=args.recovery_mode, store=store_settings(args), **_process(args),
    )


def model_spec(args: argparse.Namespace) -> ModelSpec:
    engine = {} if args.num_pages is None else {"num_pages": args.num_pages}
    return ModelSpec(args.model, args.model_name, args.random_size, args.device, args.dtype, engine)


def deferred_settings(args: argparse.Namespace, timeout_s: float = DeferredSettings.timeout_s) -> DeferredSettings:
    return DeferredSettings(
        ray_address=args.ray_address or None, namespace=args.ray_namespace, workers=max(1, args.deferred_workers),
        num_cpus=args.deferred_num_cpus, num_gpus=args.deferred_num_gpus, resource=args.deferred_resource,
        timeout_s=timeout_s,
    )


def worker_settings(args: argparse.Namespace) -> WorkerSettings:
    spec = model_spec(args)
    modes = args.recovery_modes
    settings = WorkerSettings(
        model=spec.model, model_name=spec.name, random_size=spec.random_size, device=spec.device, dtype=spec.dtype,
        engine=spec.engine, default_policy=args.policy, max_new_tokens=args.max_new_tokens, recovery_modes=modes,
        deferred=deferred_settings(args, args.deferred_timeout_s), store=store_settings(args),
    )
    if hasattr(args, "worker_id"):   # a worker process of its own (not inside `serve`)
        settings.host, settings.port, settings.advertise = args.host, args.port, args.advertise
        settings.worker_id = args.worker_id
        for name, value in _process(args).items():
            setattr(settings, name, value)
    elif args.deferred_workers > 0 and "disaggregated" not in modes:   # `serve --deferred-workers N`
        settings.recovery_modes = (*modes, "disaggregated")
    return settings
