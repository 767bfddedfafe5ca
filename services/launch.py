"""Running the services as processes: `serve` (everything in one process), `frontend`, `http`, `decode-worker`."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from .common import gc_freeze, native_heap
from .common.metrics import serve_metrics
from .common.settings import DeferredSettings, FrontendSettings, ModelSpec, StoreSettings, WorkerSettings
from .common.store import MemoryStore, Store
from .http.settings import HttpSettings

log = logging.getLogger(__name__)


def _store(settings: StoreSettings) -> Store:
    """A RedisStore at REDIS_URL, or the in-process MemoryStore without one."""
    if not settings.redis_url:
        log.info("no REDIS_URL: using the in-process store (this process only)")
        return MemoryStore(settings.session_ttl_s)
    from .common.redis_store import RedisStore

    return RedisStore(settings.redis_url, settings.prefix, settings.session_ttl_s)


def _metrics(port: int | None, host: str) -> None:
    if port is not None:
        log.info("Prometheus /metrics at http://%s:%d/metrics", host, serve_metrics(port, host))


def _until_signal(stops: list[Callable[[], None]]) -> None:
    """Block until SIGINT/SIGTERM, then run `stops` in order."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    # Not a bare wait(): Python runs a signal's handler only when the main thread wakes, and a signal the
    # kernel hands to another thread does not wake a main thread blocked on a lock.
    while not done.wait(0.5):
        pass
    log.info("shutting down")
    for stop in stops:
        stop()


def serve(front: FrontendSettings, worker: WorkerSettings, http: HttpSettings | None = None) -> None:
    """The embedded default: a frontend and one decode worker (colocated recovery; with
    `--deferred-workers N`, disaggregated too, on a local Ray) in this process, talking gRPC over
    loopback, sharing one store (in-process unless REDIS_URL is set); with an HTTP port, the HTTP API
    too. The frontend starts first: until the model has loaded it answers UNAVAILABLE, which
    `raincheck chat` shows as a progress line."""
    from .frontend.server import FrontendServer

    native_heap.bound()

    store = _store(front.store)
    _metrics(front.metrics_port, front.metrics_host)
    f = FrontendServer(front, store).start()
    print(f"raincheck frontend on {f.address}; loading {worker.model or 'the default model'} "
          f"({worker.device}, {worker.dtype}) ...", flush=True)
    try:
        from .decode_worker.server import DecodeWorkerServer

        w = DecodeWorkerServer(worker, store).start()
    except BaseException:
        f.stop(0)
        store.close()
        raise
    gc_freeze.freeze()       # the loaded, warmed engine: out of the collector's full passes
    print(f"raincheck serving {w.model} on {f.address}  (raincheck chat --address {f.address})", flush=True)
    stops = [lambda: f.stop(front.drain_s), lambda: w.stop(front.drain_s), store.close]
    if http is not None and http.port is not None:
        from .http.server import HttpServer

        try:
            h = HttpServer(http, front, store, f.router).start()
        except BaseException:
            f.stop(0)
            w.stop(0)
            store.close()
            raise
        print(f"HTTP API on {h.url}  (OpenAI base_url {h.url}/v1, SGLang {h.url}/generate)", flush=True)
        stops.insert(0, lambda: h.stop(front.drain_s))
    _until_signal(stops)


def run_frontend(settings: FrontendSettings) -> None:
    from .frontend.server import FrontendServer

    store = _store(settings.store)
    _metrics(settings.metrics_port, settings.metrics_host)
    f = FrontendServer(settings, store).start()
    print(f"raincheck frontend on {f.address}", flush=True)
    _until_signal([lambda: f.stop(settings.drain_s), store.close])


def run_http(front: FrontendSettings, http: HttpSettings) -> None:
    """The HTTP API alone, in front of the workers and sessions of the store (Redis, to share them)."""
    from .http.server import HttpServer

    store = _store(front.store)
    _metrics(front.metrics_port, front.metrics_host)
    h = HttpServer(http, front, store).start()
    print(f"raincheck HTTP API on {h.url}  (OpenAI base_url {h.url}/v1, SGLang {h.url}/generate)", flush=True)
    _until_signal([lambda: h.stop(front.drain_s), store.close])


def run_decode_worker(settings: WorkerSettings) -> None:
    from .decode_worker.server import DecodeWorkerServer

    native_heap.bound()

    store = _store(settings.store)
    if not settings.store.redis_url:
        log.warning("a decode worker without REDIS_URL registers in its own in-process store: "
                    "no separate frontend can find it")
    _metrics(settings.metrics_port, settings.metrics_host)
    w = DecodeWorkerServer(settings, store).start()
    gc_freeze.freeze()
    print(f"raincheck decode worker {w.worker_id} ({w.model}) on {w.address}", flush=True)
    _until_signal([lambda: w.stop(settings.drain_s), store.close])


def run_deferred_workers(settings: DeferredSettings, spec: ModelSpec) -> None:
    from .deferred_worker.keeper import Keeper

    keeper = Keeper(settings, spec).start()
    print(f"raincheck deferred workers {', '.join(keeper.names)} in Ray namespace {settings.namespace} "
          f"(RAY_ADDRESS={keeper.address()})", flush=True)
    _until_signal([keeper.stop])
