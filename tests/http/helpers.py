"""The HTTP frontend on loopback, in front of a decode worker serving the demo model (greedy answers
about synthetic scenes), next to the gRPC frontend on the same store. The answers these tests compare
are v1's (`models/demo`, the name "demo-v1"), served under the name "demo"."""

from __future__ import annotations

import base64
import random
import time
from pathlib import Path

from openai import OpenAI

from raincheck_client import Client
from raincheck_demo.world import Dialogue, make_dialogue
from services.common.settings import FrontendSettings, WorkerSettings
from services.common.store import Store
from services.decode_worker.server import DecodeWorkerServer
from services.frontend.server import FrontendServer
from services.http.server import HttpServer
from services.http.settings import HttpSettings
from tests.demo.helpers import FOLDER

KEYS = ("key-alice", "key-bob")
MODEL = "demo"
MAX_TOKENS = 48                        # room for a 12-object list answer (36 tokens)


class Stack:
    """One decode worker (demo model), the gRPC frontend and the HTTP frontend, on `store`."""

    def __init__(self, store: Store, http: HttpSettings | None = None, folder: Path = FOLDER, tpot_slo: float = 0.0,
                 calibrate: bool = False, engine: dict | None = None, **frontend):
        self.store = store
        self.worker = DecodeWorkerServer(WorkerSettings(
            model=str(folder), model_name=MODEL, port=0, metrics_port=None, engine={"num_threads": 2, **(engine or {})},
            heartbeat_s=0.5, registration_ttl_s=5.0, threads=16, calibrate=calibrate,
            tpot_slo=tpot_slo), store).start()  # 0, fixed chunks: answers comparable across paths (no timing)
        self.frontend_settings = FrontendSettings(port=0, metrics_port=None, threads=16,
                                                  **{"api_keys": KEYS, **frontend})
        self.grpc = FrontendServer(self.frontend_settings, store).start()
        self.https = [HttpServer(http or HttpSettings(port=0), self.frontend_settings, store, self.grpc.router).start()]
        self.clients: list[Client] = []

    @property
    def http(self) -> HttpServer:
        return self.https[0]

    def another_http(self) -> HttpServer:
        """A second HTTP frontend on the same store (as another process would be)."""
        server = HttpServer(HttpSettings(port=0), self.frontend_settings, self.store).start()
        self.https.append(server)
        return server

    def openai(self, key: str = KEYS[0], server: HttpServer | None = None) -> OpenAI:
        return OpenAI(base_url=(server or self.http).url + "/v1", api_key=key, max_retries=0, timeout=120)

    def sdk(self, key: str = KEYS[0]) -> Client:
        client = Client(self.grpc.address, api_key=key)
        self.clients.append(client)
        return client

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait until no turn runs and no deferred token is pending: what runs next batches alone."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.worker.runtime.stats()
            if not stats.active_turns and not stats.deferred_pending_tokens:
                return
            time.sleep(0.02)
        raise TimeoutError("the worker did not settle")

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for server in self.https:
            server.stop(0)
        self.grpc.stop(0)
        self.worker.stop(0)
        self.store.close()


def random_model_stack(folder: Path, chat_template: Path) -> Stack:
    """A stack serving a tiny random checkpoint saved in `folder`, its tokenizer given `chat_template`."""
    from transformers import AutoTokenizer

    from services.common.random_model import save_random_model
    from services.common.store import MemoryStore

    save_random_model(folder, "tiny")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = chat_template.read_text()
    tokenizer.save_pretrained(folder)
    return Stack(MemoryStore(), folder=folder)


def dialogue(seed: int, turns: int = 3) -> Dialogue:
    return make_dialogue(random.Random(seed), turns=turns)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def user(text: str, image: bytes | None = None) -> dict:
    """An OpenAI user message: the image (as a data URL) first, then the text."""
    if image is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                        {"type": "text", "text": text}]}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}

