"""Service settings: one validated dataclass per component, each field declared once with its default,
its environment variable and its help.

A field made with `setting(default, "ENV_VAR", "help")` is also a command-line flag (`--field-name`, or
`flag=`); `services/common/flags.py` builds the flags from these declarations (flag > env > default) and
reports a bad value as one line. A field made with plain `Field(...)` or a default is set only from code.
To add a setting: add one `setting(...)` field here, then read it where it is used.

Values are validated on construction (pydantic), from flags, the environment or code alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator
from pydantic.dataclasses import dataclass

from .grpc_util import is_loopback

MiB = 1024 * 1024
RecoveryMode = Literal["colocated", "disaggregated"]      # recovery_modes.py maps them to the wire's enum
# The engine's choices (raincheck_core.deferral.policy.POLICIES, raincheck_core.config.DTYPES, BACKENDS), spelled
# out here because settings are read by processes that never import torch; tests/services/test_cli.py
# checks that they agree.
Policy = Literal["full", "hard", "raincheck", "post_answer"]
DType = Literal["float32", "bfloat16", "float16"]
Backend = Literal["auto", "native", "torch", "flex", "fla"]      # raincheck_core.config.BACKENDS
SpeculativeMethod = Literal["ngram", "mtp"]       # raincheck_core.speculative.config.METHODS
RandomSize = Literal["tiny", "bench"]
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                     BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v)]


def _off(value: Any) -> Any:
    """-1, "off" or "" turn an optional port off."""
    return None if value in (-1, "-1", "off", "") else value


def _tpot_slo(value: float) -> float:
    if 0 < value < 1:
        raise ValueError("a TPOT objective is a ratio of the plain decode step: >= 1, or 0 for none")
    return value


def _checkpoint(model: str | None) -> str | None:
    """A checkpoint folder, or the name of a shipped model (raincheck_core/models/shipped.py)."""
    if model is None or (Path(model) / "config.json").is_file():
        return model
    names = " such as 'demo'"
    if "/" not in model:
        # imports torch, so only for a value that may be a name (a name wins over a folder of that name)
        from raincheck_core.models.shipped import SHIPPED

        if model in SHIPPED:
            return model
        names = ": " + ", ".join(SHIPPED)
    what = "has no config.json" if Path(model).is_dir() else "is not a folder"
    raise ValueError(f"no checkpoint at {model}: it {what} (give a Hugging Face checkpoint folder, or the name "
                     f"of a shipped model{names})")


def _device(device: str) -> str:
    """A torch device this machine has: checked before anything loads (torch only for a non-CPU value)."""
    if device == "cpu":
        return device
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{device!r} is not a device: use cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return device
    if parsed.type != "cuda":
        raise ValueError(f"device {device!r} is not supported: use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"{why} (use --device cpu)")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


Device = Annotated[str, AfterValidator(_device)]
Port = Annotated[int, Field(ge=0, le=65535)]
OptionalPort = Annotated[Port | None, BeforeValidator(_off)]
Checkpoint = Annotated[str | None, AfterValidator(_checkpoint)]
TpotSlo = Annotated[float, Field(ge=0, allow_inf_nan=False), AfterValidator(_tpot_slo)]
BarrierTimeout = Annotated[Annotated[float, Field(ge=0, allow_inf_nan=False)] | None, BeforeValidator(_off)]
RecoveryModes = Annotated[tuple[RecoveryMode, ...], Field(min_length=1),
                          AfterValidator(lambda modes: tuple(dict.fromkeys(modes)))]


def no_auth_refusal(api_keys: tuple[str, ...], allow_no_auth: bool, host: str, service: str = "") -> str | None:
    """Why serving on `host` is refused (`service`: what is served, named in the message), or None: without
    API keys only a loopback address is served, unless --insecure-allow-no-auth says otherwise."""
    if api_keys or allow_no_auth or is_loopback(host):
        return None
    return (f"refusing to serve{f' {service}' if service else ''} without API keys on {host}: set --api-keys "
            "(or RAINCHECK_API_KEYS), or pass --insecure-allow-no-auth")


def setting(default: Any = None, env: str | None = None, help: str = "", *, flag: str | None = None,
            shown: str | None = None, factory: Any = None, **constraints: Any) -> Any:
    """A field that is also a flag read from `env` when not given. `shown`: how --help names the default
    when the value itself says little (None, a factory)."""
    extra = {"env": env, "flag": flag, "shown": shown}
    kwargs = {"default_factory": factory} if factory is not None else {"default": default}
    return Field(description=help, json_schema_extra={k: v for k, v in extra.items() if v is not None},
                 **kwargs, **constraints)


@dataclass
class StoreSettings:
    redis_url: str | None = setting(None, "REDIS_URL", "Redis for shared state (redis://host:port/db)",
                                    shown="an in-process store (this process only)")
    prefix: str = setting("raincheck:", "RAINCHECK_STORE_PREFIX", "Redis key prefix", flag="--store-prefix")
    session_ttl_s: float = setting(86400.0, "RAINCHECK_SESSION_TTL_S",
                                   "a session record expires this long after its last turn", gt=0)


@dataclass
class FrontendSettings:
    host: str = setting("127.0.0.1", "RAINCHECK_HOST", "address the frontend listens on")
    port: Port = setting(50051, "RAINCHECK_PORT", "port the frontend listens on (0: any free port)")
    api_keys: tuple[str, ...] = setting((), "RAINCHECK_API_KEYS", "comma-separated API keys", shown="none")
    api_keys_file: str | None = setting(None, "RAINCHECK_API_KEYS_FILE", "file with one API key per line",
                                        shown="none")
    allow_no_auth: bool = setting(False, "RAINCHECK_INSECURE_ALLOW_NO_AUTH",
                                  "serve without API keys on a non-loopback address",
                                  flag="--insecure-allow-no-auth")
    tls_cert: str | None = setting(None, "RAINCHECK_TLS_CERT", "PEM certificate (with --tls-key)",
                                   shown="plaintext")
    tls_key: str | None = setting(None, "RAINCHECK_TLS_KEY", "PEM private key (with --tls-cert)",
                                  shown="plaintext")
    max_image_bytes: int = setting(10 * MiB, "RAINCHECK_MAX_IMAGE_BYTES", "largest encoded image accepted",
                                   shown="10485760 (10 MiB)", gt=0)
    max_images: int = setting(16, "RAINCHECK_MAX_IMAGES", "images per message", ge=0)
    max_video_frames: int = setting(64, "RAINCHECK_MAX_VIDEO_FRAMES", "frames per message, over all videos",
                                    ge=0)
    max_image_pixels: int = setting(16_777_216, "RAINCHECK_MAX_IMAGE_PIXELS", "pixels of one image or frame, "
                                    "read from its header before anything decodes it", shown="16777216 (4096²)",
                                    gt=0)
    max_message_pixels: int = setting(33_554_432, "RAINCHECK_MAX_MESSAGE_PIXELS", "pixels over all images and "
                                      "frames of one message (about 100 MB decoded)", gt=0)
    max_text_chars: int = setting(262_144, "RAINCHECK_MAX_TEXT_CHARS", "characters of text per message", gt=0)
    max_sessions_per_key: int = setting(32, "RAINCHECK_MAX_SESSIONS_PER_KEY", "open sessions per API key "
                                        "(without API keys: no limit)", gt=0)
    max_turns_per_key: int = setting(8, "RAINCHECK_MAX_TURNS_PER_KEY", "turns streaming at once per API key "
                                     "(without API keys: no limit)", gt=0)
    max_message_bytes: int = Field(64 * MiB, gt=0)
    worker_timeout_s: float = Field(30.0, gt=0)      # unary calls to decode workers
    threads: int = Field(64, gt=0)                   # concurrent RPCs (each streaming turn holds one)
    default_recovery_mode: RecoveryMode = setting("colocated", "RAINCHECK_RECOVERY_MODE",
                                                  "recovery mode of sessions that do not ask for one",
                                                  flag="--recovery-mode")
    metrics_port: OptionalPort = setting(9464, "RAINCHECK_METRICS_PORT", "Prometheus /metrics port (-1: off)")
    metrics_host: str = setting("127.0.0.1", "RAINCHECK_METRICS_HOST", "address /metrics listens on")
    drain_s: float = setting(5.0, "RAINCHECK_DRAIN_TIMEOUT_S", "on SIGTERM, seconds running turns get to finish",
                             flag="--drain-timeout-s", ge=0)
    store: StoreSettings = Field(default_factory=StoreSettings)

    @model_validator(mode="after")
    def _auth(self) -> FrontendSettings:
        if self.api_keys_file:
            try:
                lines = Path(self.api_keys_file).read_text().splitlines()
            except OSError as e:
                raise ValueError(f"cannot read the API keys file {self.api_keys_file}: {e.strerror}") from None
            self.api_keys = tuple(dict.fromkeys(k for k in (*self.api_keys, *(s.strip() for s in lines)) if k))
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        # Checked here, so that a server refuses before it loads anything.
        if refusal := no_auth_refusal(self.api_keys, self.allow_no_auth, self.host):
            raise ValueError(refusal)
        return self


@dataclass
class ModelSpec:
    """What an Engine loads. A decode worker and its deferred workers must load the same weights."""

    model: Checkpoint = setting(None, "RAINCHECK_MODEL", "checkpoint folder, or a shipped model's name "
                                "(demo, demo-v2, demo-v1)",
                                shown="demo (models/demo-v2); without it a random model")
    model_name: str | None = setting(None, "RAINCHECK_MODEL_NAME", "the name clients ask for",
                                     shown="the folder's name")
    random_size: RandomSize = setting("tiny", "RAINCHECK_RANDOM_SIZE",
                                      "size of the random model served when there is no checkpoint")
    device: Device = setting("cpu", "RAINCHECK_DEVICE", "torch device (cpu, cuda, cuda:1, ...)")
    dtype: DType = setting("float32", "RAINCHECK_DTYPE",
                           "weights and activations: float32 on CPUs, bfloat16 on GPUs")
    num_pages: int | None = setting(None, "RAINCHECK_NUM_PAGES", "KV pages in the pool (16 tokens each)",
                                    shown="the engine's default", gt=0)
    max_model_len: int | None = setting(None, "RAINCHECK_MAX_MODEL_LEN", "tokens a session may hold (prompt "
                                        "and answers); longer requests are refused with 400 / INVALID_ARGUMENT",
                                        shown="the model's max_position_embeddings", gt=0)
    engine: dict = Field(default_factory=dict)    # EngineConfig options (page_size, ...); gets num_pages
    prefix_cache_pages: int | None = setting(None, "RAINCHECK_PREFIX_CACHE_PAGES", "KV pages the prefix cache "
                                             "may hold, shared between sessions (0: no prefix cache)",
                                             shown="half the pool", ge=0)
    gdn_checkpoint_mib: float | None = setting(None, "RAINCHECK_GDN_CHECKPOINT_MIB", "memory for the prefix "
                                               "cache's GDN state checkpoints (hybrid models), taken at start-up",
                                               shown="a quarter of the KV pool, at most 256", ge=0)
    encoder_cache_mib: float | None = setting(None, "RAINCHECK_ENCODER_CACHE_MIB", "memory for the vision "
                                              "tower's outputs by image content (0: off)", shown="256", ge=0)
    backend: Backend | None = setting(None, "RAINCHECK_BACKEND", "op backend: auto (cuda: FlexAttention + fla's "
                                      "GDN kernels, graph-captured decode; cpu: native kernels), native, torch, "
                                      "flex, fla", shown="auto")
    speculative_method: SpeculativeMethod | None = setting(
        None, "RAINCHECK_SPECULATIVE_METHOD", "speculative decoding: ngram (prompt lookup, any model) or mtp (the "
        "checkpoint's multi-token-prediction head, Qwen3.5); greedy answers stay the same, sampled ones keep their "
        "distribution", shown="off")
    speculative_tokens: int = setting(3, "RAINCHECK_SPECULATIVE_TOKENS", "draft tokens verified per decode step "
                                      "with --speculative-method", gt=0)
    tensor_parallel_size: int = setting(1, "RAINCHECK_TENSOR_PARALLEL_SIZE", "ranks the model is split over, one "
                                        "process (one GPU) each, started by the worker: attention and GDN heads, "
                                        "MLP widths and the vocabulary split (docs/deploy.md, Sizing)", ge=1)
    expert_parallel: bool = setting(False, "RAINCHECK_EXPERT_PARALLEL", "MoE models at --tensor-parallel-size > 1: "
                                    "the experts split across the ranks (each rank holds whole experts) rather "
                                    "than each expert's width")

    @model_validator(mode="after")
    def _engine_options(self) -> ModelSpec:
        for name in ("num_pages", "max_model_len", "backend"):
            if getattr(self, name) is not None:
                self.engine = {**self.engine, name: getattr(self, name)}
        if self.tensor_parallel_size > 1 or self.expert_parallel:
            self.engine = {**self.engine, "tensor_parallel_size": self.tensor_parallel_size,
                           "expert_parallel": self.expert_parallel}
        if self.prefix_cache_pages is not None:
            self.engine = {**self.engine, **({"prefix_cache_pages": self.prefix_cache_pages}
                                             if self.prefix_cache_pages else {"prefix_cache": False})}
        if self.speculative_method is not None:     # plain data: the spec travels to deferred workers as JSON
            self.engine = {**self.engine, "speculative": {"method": self.speculative_method,
                                                          "num_tokens": self.speculative_tokens}}
        for name, option in (("gdn_checkpoint_mib", "gdn_checkpoint_bytes"), ("encoder_cache_mib",
                                                                             "encoder_cache_bytes")):
            if getattr(self, name) is not None:
                self.engine = {**self.engine, option: int(getattr(self, name) * MiB)}
        return self


@dataclass
class DeferredSettings:
    """Ray deferred workers, for `disaggregated` recovery (docs/services.md, Recovery modes)."""

    ray_address: str | None = setting(None, "RAY_ADDRESS", "Ray cluster of the deferred workers (host:port, or "
                                      "ray://host:10001 for Ray Client)", shown="a local Ray of the worker's own")
    namespace: str = setting("raincheck", "RAINCHECK_RAY_NAMESPACE", "Ray namespace of the deferred-worker actors",
                             flag="--ray-namespace")
    workers: int = setting(1, "RAINCHECK_DEFERRED_WORKERS", "actors to start when none is registered in the "
                           "namespace (and to keep while idle)", flag="--deferred-workers", ge=1)
    max_workers: int | None = setting(None, "RAINCHECK_DEFERRED_MAX_WORKERS", "the most actors a decode worker "
                                      "grows its own pool to while residuals wait", flag="--deferred-max-workers",
                                      shown="--deferred-workers (no growth)", ge=1)
    scale_up_wait_s: float = setting(0.5, "RAINCHECK_DEFERRED_SCALE_UP_WAIT_S", "a residual waiting this long "
                                     "for a free actor asks for one more", flag="--deferred-scale-up-wait-s", gt=0)
    idle_s: float = setting(300.0, "RAINCHECK_DEFERRED_IDLE_S", "an actor beyond --deferred-workers idle this "
                            "long is stopped", flag="--deferred-idle-s", gt=0)
    num_cpus: float = setting(1.0, "RAINCHECK_DEFERRED_NUM_CPUS", "CPUs each deferred-worker actor asks Ray for",
                              flag="--deferred-num-cpus", ge=0)
    num_gpus: float = setting(0.0, "RAINCHECK_DEFERRED_NUM_GPUS", "GPUs each actor asks Ray for (needed for "
                              "--device cuda)", flag="--deferred-num-gpus", ge=0)
    resource: str = setting("raincheck_deferred", "RAINCHECK_DEFERRED_RESOURCE",
                            "custom Ray resource each actor asks one unit of ('': none)", flag="--deferred-resource")
    timeout_s: float = setting(120.0, "RAINCHECK_DEFERRED_TIMEOUT_S", "seconds from an answer's end until a "
                               "shipped recovery is given up on and finished locally",
                               flag="--deferred-timeout-s", gt=0)
    resident_mib: float = setting(1024.0, "RAINCHECK_DEFERRED_RESIDENT_MIB", "memory each deferred worker keeps "
                                  "sessions' contexts in between their recoveries, so only what is new is shipped "
                                  "(0: none, every recovery ships the whole context)", flag="--deferred-resident-mib",
                                  ge=0)
    ship: Literal["answer_end", "input_done"] = setting(
        "answer_end", "RAINCHECK_DEFERRED_SHIP", "when a turn's residual is shipped: at the answer's end, or as "
        "soon as the turn's input is prefilled (in flight: joined mid-answer where fused chunks could be, or "
        "after the answer)", flag="--deferred-ship")
    fuse_shipped: bool = setting(True, "RAINCHECK_DEFERRED_FUSE_SHIPPED", "while a residual is shipped in flight, "
                                 "fused chunks still restore its rows from the front (the worker's result covers "
                                 "the rest)", flag="--deferred-fuse-shipped")

    @model_validator(mode="after")
    def _bounds(self) -> DeferredSettings:
        if self.max_workers is not None and self.max_workers < self.workers:
            raise ValueError(f"--deferred-max-workers ({self.max_workers}) is below --deferred-workers "
                             f"({self.workers})")
        return self

    @property
    def most_workers(self) -> int:
        """The most actors a decode worker's own pool grows to."""
        return self.max_workers or self.workers


@dataclass
class WorkerSettings(ModelSpec):
    """A decode worker: the model it loads (ModelSpec's fields) and how it serves it."""

    host: str = setting("127.0.0.1", "RAINCHECK_WORKER_HOST", "address the decode worker listens on")
    port: Port = setting(50061, "RAINCHECK_WORKER_PORT", "port the decode worker listens on (0: any free port)")
    advertise: str | None = setting(None, "RAINCHECK_ADVERTISE", "host:port frontends dial",
                                    shown="host:bound port")
    worker_id: str | None = setting(None, "RAINCHECK_WORKER_ID", "this worker's id in the store",
                                    shown="a random one")
    default_policy: Policy = setting("raincheck", "RAINCHECK_POLICY", "deferral policy of sessions that do not "
                                     "ask for one", flag="--policy")
    tpot_slo: TpotSlo = setting(1.10, "RAINCHECK_TPOT_SLO", "allowed mean TPOT of answers, as a ratio of a plain "
                                "decode step, for sessions that do not ask (0: none, fixed deferred chunks)")
    barrier_timeout_s: BarrierTimeout = setting(None, "RAINCHECK_BARRIER_TIMEOUT_S", "seconds a turn waits for "
                                                "the previous turn's deferred rows before it runs beside them, for "
                                                "sessions that do not ask (0: never wait; off: wait for all)",
                                                shown="off")
    max_new_tokens: int = setting(256, "RAINCHECK_MAX_NEW_TOKENS", "answer length limit of requests that do not "
                                  "say", gt=0)
    deterministic: bool = setting(False, "RAINCHECK_DETERMINISTIC", "deterministic mode for sessions that do not "
                                  "ask: the same answer for the same request whatever else runs (costs TPOT "
                                  "under load)")
    calibrate: bool = setting(True, "RAINCHECK_CALIBRATE", "before reporting ready, measure the step costs the TPOT "
                              "objective needs (each chunk bucket at decode batch sizes 1, 2, 4)")
    heartbeat_s: float = Field(2.0, gt=0)
    registration_ttl_s: float = Field(10.0, gt=0)
    session_idle_s: float = setting(600.0, "RAINCHECK_SESSION_IDLE_S", "seconds without a turn after which a "
                                    "session's cache is freed (its next turn rebuilds it from the turn log)", gt=0)
    threads: int = Field(64, gt=0)
    max_message_bytes: int = Field(256 * MiB, gt=0)   # rebuilds carry a session's whole history
    metrics_port: OptionalPort = setting(9465, "RAINCHECK_METRICS_PORT", "Prometheus /metrics port (-1: off)")
    metrics_host: str = setting("127.0.0.1", "RAINCHECK_METRICS_HOST", "address /metrics listens on")
    drain_s: float = setting(5.0, "RAINCHECK_DRAIN_TIMEOUT_S", "on SIGTERM, seconds running turns get to finish",
                             flag="--drain-timeout-s", ge=0)
    recovery_modes: RecoveryModes = setting(("colocated",), "RAINCHECK_RECOVERY_MODES",
                                            "comma-separated recovery modes offered")
    deferred: DeferredSettings = Field(default_factory=DeferredSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)

    def model_spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.model_name, self.random_size, self.device, self.dtype, self.num_pages,
                         self.max_model_len, self.engine)


@dataclass
class ServeSettings:
    """`raincheck serve`'s own choices (the frontend's and the worker's are theirs)."""

    deferred_workers: int = setting(0, "RAINCHECK_DEFERRED_WORKERS", "N > 0: start a local Ray with N "
                                    "deferred-worker actors and offer disaggregated recovery too", ge=0)


@dataclass
class ChatSettings:
    address: str = setting("127.0.0.1:50051", "RAINCHECK_ADDRESS", "the server's host:port")
    api_key: str | None = setting(None, "RAINCHECK_API_KEY", "API key", shown="none")
    session: str | None = setting(None, "RAINCHECK_SESSION", "continue this session instead of opening one",
                                  shown="a new session")
    policy: Policy | None = setting(None, "RAINCHECK_CHAT_POLICY", "deferral policy of the new session",
                                    shown="the server's")
    max_new_tokens: int = setting(64, "RAINCHECK_CHAT_MAX_NEW_TOKENS", "answer length limit", gt=0)
    wait_s: float = setting(60.0, "RAINCHECK_CHAT_WAIT_S", "how long to wait for a server that is unreachable "
                            "or still loading its model", ge=0)


@dataclass
class DemoSettings:
    model: Checkpoint = setting(None, "RAINCHECK_MODEL", "checkpoint folder, or a shipped model's name "
                                "(demo, demo-v2, demo-v1)",
                                shown="demo (models/demo-v2); without it a random model")
    max_new_tokens: int = setting(48, "RAINCHECK_DEMO_MAX_NEW_TOKENS", "room for a 36-token list answer", gt=0)


@dataclass
class LogSettings:
    """Options of every command (before or after its name)."""

    log_level: LogLevel = setting("INFO", "RAINCHECK_LOG_LEVEL", "log level")
    plain_logs: bool = setting(False, "RAINCHECK_PLAIN_LOGS", "human-readable logs instead of JSON lines")
    debug: bool = setting(False, "RAINCHECK_DEBUG", "show the traceback of an error")
