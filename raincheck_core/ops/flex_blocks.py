"""The block lists of a FlexAttention group (ops/flex_layout.py builds its groups from them): the flat
`kv_indices` buffers, and two ways to fill them from a step's page runs, in numpy on the host (the layout
makes its tensors once, at the end)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

ALIGN = 16      # int32 entries: 64 bytes


def buffer_length(n: int, tiles: int, cols: int, pages: int) -> int:
    """Entries of a group's flat `kv_indices` buffer: `cols` per tile, and the tail the strided view's last
    row spans (ops/flex_groups.py `FlexGroup.block_mask`). The indices' last dimension must span the pool's
    pages (FlexAttention checks the key length against it), but the kernel reads only each tile's first
    `kv_num_blocks` entries, so the buffer grows with the blocks listed, not with the pool. Rounded up to
    `ALIGN` entries, so that a second buffer laid after one in the same array (the one-row group's full list
    after its partial one) starts 64-byte aligned, as a GPU kernel's inputs should."""
    return -(-(n * tiles * cols + max(0, pages - cols)) // ALIGN) * ALIGN


def block_buffer(n: int, tiles: int, cols: int, pages: int) -> np.ndarray:
    """A group's flat `kv_indices` buffer (`buffer_length`), zero."""
    return np.zeros(buffer_length(n, tiles, cols, pages), dtype=np.int32)


def write_runs(buf: np.ndarray, rows: np.ndarray, col: np.ndarray | int, start: np.ndarray, length: np.ndarray,
                pages: np.ndarray, cols: int) -> None:
    """Write `pages[start[i]:start[i] + length[i]]` into tile `rows[i]`'s list of `buf` from column `col[i]`."""
    total = int(length.sum())
    if not total:           # often: decode rows list no run past their full prefix, prefills skip no slot
        return
    which = np.repeat(np.arange(length.shape[0]), length)
    offset = np.arange(total) - (length.cumsum() - length)[which]
    at = col[which] + offset if isinstance(col, np.ndarray) else offset
    buf[rows[which] * cols + at] = pages[start[which] + offset]


def prefix_lists(num: np.ndarray, pages: np.ndarray, start: np.ndarray, cols: int, length: int) -> np.ndarray:
    """A block buffer of `length` entries (`buffer_length`) where tile t of segment i lists
    `pages[start[i]:start[i] + num[i, t]]` (`num [n, tiles]`, its first rows the segments of `start`), every
    entry written once: each segment's next `cols` pages copied as a row of a sliding window over them, times
    a row of a triangle of flags (`c < num`), both row gathers rather than an elementwise index and compare."""
    tiles = num.shape[1]
    m = start.shape[0]
    buf = np.empty(length, dtype=np.int32)
    padded = np.zeros(pages.shape[0] + cols, dtype=np.int32)
    padded[:pages.shape[0]] = pages
    lists = np.lib.stride_tricks.sliding_window_view(padded, cols)[start]
    np.multiply(lists[:, None], _below(cols)[num[:m]], out=buf[:m * tiles * cols].reshape(m, tiles, cols))
    buf[m * tiles * cols:] = 0
    return buf


@lru_cache(maxsize=4)
def _below(cols: int) -> np.ndarray:
    """`below[k, c]`: c < k, for k in [0, cols]; the same for every step of a block-list width (read only),
    made once: at 2,048 columns (32K-token lists) it is 4 MB, and making it was most of a long step's layout."""
    below = np.tril(np.ones((cols + 1, cols), dtype=bool), -1)
    below.flags.writeable = False
    return below
