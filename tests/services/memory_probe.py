"""Peak memory a refused request costs the embedded server: `python -m tests.services.memory_probe CHECKPOINT`
prints one JSON object, {case: {"code": status name, "peak_growth_mb": growth of the process's peak RSS}}.

A process of its own, so that its peak RSS says what these requests cost and nothing else (the server,
its model and one accepted image turn are already in it when it measures)."""

from __future__ import annotations

import json
import resource
import sys

from raincheck_client import Client, RaincheckError
from services.common.settings import FrontendSettings, WorkerSettings
from services.common.store import MemoryStore
from services.decode_worker.server import DecodeWorkerServer
from services.frontend.server import FrontendServer
from tests.multimodal.mm_helpers import huge_png, png

CASES = {"png_9000x9000": dict(text="what is this ?", images=[huge_png()]),
         "text_6M_chars": dict(text="what is this ? " * 400_000)}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # KiB on Linux


def main(checkpoint: str) -> dict:
    store = MemoryStore()
    worker = DecodeWorkerServer(WorkerSettings(model=checkpoint, port=0, metrics_port=None), store).start()
    frontend = FrontendServer(FrontendSettings(port=0, metrics_port=None), store).start()
    out = {}
    try:
        with Client(frontend.address) as client:
            session = client.create_session()
            session.send("what is this ?", images=[png()], max_new_tokens=4).text()
            requests = {name: dict(send) for name, send in CASES.items()}   # built before measuring
            for name, send in requests.items():
                before = _peak_mb()
                try:
                    session.send(**send, max_new_tokens=4).text()
                    code = "OK"
                except RaincheckError as e:
                    code = e.code
                out[name] = {"code": code, "peak_growth_mb": round(_peak_mb() - before, 1)}
    finally:
        frontend.stop(0)
        worker.stop(0)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
