"""What sessions share through the prefix cache (cache/prefix.py): a step's newly completed full pages are
published, and a new session's first turn adopts the longest cached prefix of its input. Kept apart from
the core's transitions: both are page bookkeeping the core calls at one point each (settling a step,
admitting a turn)."""

from __future__ import annotations

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool
from ..cache.prefix import PrefixCache
from .request import TurnRequest
from .session_cache import SessionCache


def publish(prefix: PrefixCache | None, kv: KVPool, gdn: GDNStatePool | None, cache: SessionCache,
            scratch: bool) -> None:
    """Hand the cache's newly completed full pages to the prefix cache, with the GDN state after the last
    one when the step ended there (`scratch`: a scratch session's, never published)."""
    chain = cache.chain
    states, cache.gdn_checkpoints = cache.gdn_checkpoints, {}    # taken inside this step's prefills
    if prefix is None or scratch or len(chain.hashes) <= cache.published:
        return
    done = len(chain.hashes)
    if gdn is not None and cache.length == done * kv.page_size:
        states[done] = (gdn.conv[cache.gdn_slot], gdn.ssm[cache.gdn_slot])
    prefix.publish(chain.hashes[:done], cache.table.pages[:done], cache.published, states)
    cache.published = done


def reuse_prefix(prefix: PrefixCache | None, page_size: int, request: TurnRequest) -> int:
    """A new session's turn starts on the longest prefix of its input the prefix cache holds (at least
    its last row is run: its logits give the first token). Returns the rows served from the cache."""
    cache, rows = request.cache, request.input
    if prefix is None or cache.length or cache.pending_ids or rows.row_keys is None:
        return 0
    hit = prefix.match(rows.row_keys, len(rows) - 1)
    if hit is None:
        return 0
    n = len(hit.pages) * page_size
    cache.adopt(hit, rows.row_keys[:n], rows.token_ids[:n])
    request.skip_cached(n)
    return n
