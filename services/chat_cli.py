"""`raincheck chat`: an interactive chat with a Raincheck server, showing tokens as they stream, the
turn's timings and the recovery of its deferred visual tokens.

Lines are messages; `/image PATH` attaches an image to the next message, `/status` shows the session,
`/quit` (or end of input) leaves and closes the session. A server that is still starting (unreachable,
or up without a loaded model yet) is waited for, with a progress line, for up to `--wait-s` seconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path

from raincheck_client import (
    Client,
    Event,
    Final,
    Metrics,
    RaincheckError,
    RecoveryProgress,
    Session,
    SessionInfo,
    Token,
    Unavailable,
)

from .common.settings import ChatSettings

HELP = "/image PATH attaches an image to the next message, /status, /quit"


def _turn(session: Session, text: str, images: list[bytes], max_new_tokens: int) -> None:
    """Stream one turn. Ctrl-C while it streams cancels the turn (the session keeps what came before it)
    and returns to the prompt; Ctrl-C at the prompt, or again while cancelling, leaves the chat."""
    turn = session.send(text, images=images, max_new_tokens=max_new_tokens, follow_recovery=True)
    try:
        _show(turn)
    except KeyboardInterrupt:
        print("\n  cancelling the turn (Ctrl-C again leaves)", flush=True)
        turn.cancel()            # stop reading: the server cancels the turn ...
        session.cancel()         # ... and this returns once it has, so the next message finds it idle
        print("  [cancelled]")


def _show(turn: Iterable[Event]) -> None:
    answered, deferred = False, 0
    for event in turn:
        if isinstance(event, Token):
            print(event.text, end="", flush=True)
        elif isinstance(event, Metrics):
            deferred = event.deferred_tokens
            extra = f", {deferred} visual tokens deferred" if deferred else ""
            print(f"\n  TTFT {1e3 * event.ttft_s:.0f} ms, TPOT {1e3 * event.tpot_s:.0f} ms, "
                  f"E2E {1e3 * event.e2e_s:.0f} ms{extra}", end="")
        elif isinstance(event, Final):
            print(f"  [{event.finish_reason}]")
            answered = True
        elif isinstance(event, RecoveryProgress) and answered and deferred:
            # after the answer: the rest of the deferred tokens being prefilled, on one line
            state = f"complete in {event.elapsed_s:.2f} s" if event.complete else f"{event.pending_tokens} left"
            print(f"\r  recovery of deferred tokens: {state}   ", end="\n" if event.complete else "", flush=True)


def status_table(info: SessionInfo) -> str:
    """A session's status as a few aligned lines."""
    knobs = [f"selector {info.selector}"] if info.selector else []
    knobs += [f"{name} {value:g}" for name, value in (("retention", info.retention), ("chunk", info.chunk_size),
                                                       ("guard", info.guard)) if value is not None]
    rows = [("session", info.session_id),
            ("model", f"{info.model} (worker {info.worker_id})" if info.worker_id else info.model),
            ("policy", info.policy + (f" ({', '.join(knobs)})" if knobs else "")),
            ("recovery", info.recovery_mode),
            ("status", info.status),
            ("turns", str(info.turns)),
            ("cached", f"{info.cached_tokens} tokens"),
            ("pending", f"{info.pending_deferred_tokens} deferred tokens")]
    return "\n".join(f"  {name:<9}{value}" for name, value in rows)


def _wait_ready(client: Client, address: str, wait_s: float) -> None:
    """The SDK's own wait for a server that is starting (`Client.wait_ready`), with a progress line."""
    start = time.monotonic()
    shown = False

    def progress(why: str, waited: float) -> None:
        nonlocal shown
        print(f"\r  waiting for the server at {address} ({why}): {waited:.0f} s of {wait_s:.0f} s ", end="", flush=True)
        shown = True

    try:
        client.wait_ready(wait_s, progress)
    except Unavailable:
        if shown:
            print()
        raise
    if shown:
        print(f"\r  the server at {address} is ready after {time.monotonic() - start:.0f} s" + " " * 30)


def _attach(path: str, images: list[bytes]) -> None:
    """Read the image now, so a bad path is reported here and never queued."""
    if not path:
        print("usage: /image PATH")
        return
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        print(f"cannot attach {path}: {e.strerror or e}")
        return
    if not data:
        print(f"cannot attach {path}: the file is empty")
        return
    images.append(data)
    size = f"{len(data) / 1024:.0f} KiB" if len(data) >= 1024 else f"{len(data)} bytes"
    print(f"  attached {path} ({size}); it goes with your next message")


def _line(line: str, session: Session, images: list[bytes], max_new_tokens: int) -> None:
    """One input line: a command, or a message that takes the attached images along (kept or not, they
    are used up, so one bad image never spoils the next message)."""
    if line == "/status":
        print(status_table(session.status()))
    elif line == "/image" or line.startswith("/image "):
        _attach(line.removeprefix("/image").strip(), images)
    elif line.startswith("/"):
        print(f"unknown command {line.split()[0]}; {HELP}")
    elif line or images:
        attached = images[:]
        images.clear()
        try:
            _turn(session, line, attached, max_new_tokens)
        except RaincheckError as e:
            dropped = f" ({len(attached)} attached image(s) dropped; /image attaches again)" if attached else ""
            print(f"\nerror: {e}{dropped}")


def run_chat(settings: ChatSettings) -> None:
    with Client(settings.address, api_key=settings.api_key) as client:
        _wait_ready(client, settings.address, settings.wait_s)
        session = (client.session(settings.session) if settings.session
                   else client.create_session(policy=settings.policy))
        info = session.info
        print(f"session {session.id} on {info.model} ({info.policy}, {info.recovery_mode} recovery); {HELP}")
        images: list[bytes] = []
        try:
            for line in sys.stdin:
                line = line.strip()
                if line == "/quit":
                    break
                try:
                    _line(line, session, images, settings.max_new_tokens)
                except RaincheckError as e:
                    print(f"\nerror: {e}")
        finally:
            try:
                session.close()
            except RaincheckError as e:
                print(f"could not close the session: {e}")
