"""`raincheck chat`: an interactive chat with a Raincheck server, showing tokens as they stream, the
turn's timings and the recovery of its deferred visual tokens.

Lines are messages; `/image PATH` attaches an image to the next message, `/status` shows the session,
`/quit` (or end of input) leaves and closes the session.
"""

from __future__ import annotations

import sys

from raincheck_client import Client, Final, Metrics, RaincheckError, RecoveryProgress, Session, Token


def _turn(session: Session, text: str, images: list[str], max_new_tokens: int) -> None:
    answered, deferred = False, 0
    for event in session.send(text, images=images, max_new_tokens=max_new_tokens, follow_recovery=True):
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


def run_chat(address: str, api_key: str | None, session_id: str | None, policy: str | None,
             max_new_tokens: int) -> None:
    with Client(address, api_key=api_key) as client:
        session = client.session(session_id) if session_id else client.create_session(policy=policy)
        info = session.info
        print(f"session {session.id} on {info.model} ({info.policy}, {info.recovery_mode} recovery); "
              "/image PATH, /status, /quit")
        images: list[str] = []
        for line in sys.stdin:
            line = line.strip()
            try:
                if line == "/quit":
                    break
                if line == "/status":
                    print(session.status())
                elif line.startswith("/image "):
                    images.append(line.removeprefix("/image ").strip())
                elif line or images:
                    _turn(session, line, images, max_new_tokens)
                    images = []
            except (RaincheckError, OSError) as e:
                print(f"error: {e}")
        session.close()
