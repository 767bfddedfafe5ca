"""Whether a turn can ever be served: the size checks made before it is admitted (a 400, not a 429)."""

from __future__ import annotations

from ..errors import RequestTooLargeError
from .session_cache import SessionCache


def check_fits(cache: SessionCache, prompt: int, deferred: int, max_new_tokens: int, n: int, *,
               page_size: int, pool_pages: int, max_model_len: int | None) -> None:
    """RequestTooLargeError when a turn of `prompt` rows run now, `deferred` later and up to
    `max_new_tokens` generated (for each of `n` answers) can never be served: past the context length
    `max_model_len`, or more slots than the session's page budget or the whole KV pool (`pool_pages` of
    `page_size` slots) holds. What waiting can cure is left to admission."""
    # the previous turn's deferred rows not restored yet will be in the cache before this turn runs
    held = cache.length + sum(r.pending for r in cache.recoveries())
    total = held + prompt + deferred + max_new_tokens
    detail = f"the conversation holds {held}, this turn's prompt is {prompt + deferred} and max_new_tokens " \
             f"is {max_new_tokens}: {total} requested"
    if max_model_len is not None and total > max_model_len:
        raise RequestTooLargeError(f"this model's maximum context length is {max_model_len} tokens; {detail}",
                                   max_model_len, total)
    for pages, what in ((cache.table.max_pages, "a session of this worker"), (pool_pages, "this worker's KV pool")):
        if total > pages * page_size:
            raise RequestTooLargeError(f"{what} holds at most {pages * page_size} tokens; {detail}",
                                       pages * page_size, total)
    if n > 1:
        # every other answer shares the prompt's full pages and holds the rest (partial page and answer)
        context = held + prompt + deferred
        own = -(-(context % page_size + max_new_tokens) // page_size)
        needed = -(-total // page_size) + (n - 1) * own
        if needed > pool_pages:
            raise RequestTooLargeError(
                f"n={n} answers of up to {max_new_tokens} tokens after a {context}-token context need {needed} "
                f"KV pages of {page_size} tokens; this worker's KV pool holds {pool_pages} pages",
                pool_pages * page_size, needed * page_size)
