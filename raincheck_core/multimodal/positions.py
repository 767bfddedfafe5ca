"""3-D M-RoPE positions of a prompt, computed by the project (no transformers at run time).

Matches transformers' `get_rope_index` (Qwen3VLModel / Qwen3_5Model, see docs/mechanism.md §3):
text tokens get `(p, p, p)` and advance `p` by one; a visual run with merged grid `(t, H, W)` gets
`(p + ti, p + r, p + c)` row-major and advances `p` by `max(H, W)`. A video is split per temporal patch:
each of its `t` runs restarts like an image at the current `p` (the timestamp text between runs moves `p`).

`start` shifts everything, so a later turn of a session continues the running position: the result equals
the positions of the same tokens appended after `start` text tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError
from ..inputs import VisualInput, VisualKind

_TEXT, _IMAGE, _VIDEO = 0, 1, 2
_KIND_NAMES = {_IMAGE: "image", _VIDEO: "video"}


@dataclass
class VisualSpan:
    """Where one visual input's tokens are in the prompt."""

    index: int                  # index into the `visuals` list
    kind: VisualKind
    token_indices: torch.Tensor  # long [N]: indices into token_ids, in source (embedding row) order


@dataclass
class PromptLayout:
    positions: torch.Tensor     # long [3, T]: (t, h, w) per token
    next_position: int          # max position + 1: what the next text / generated token gets
    spans: list[VisualSpan]


def compute_positions(
    token_ids: Sequence[int] | torch.Tensor,
    visuals: Sequence[VisualInput],
    *,
    image_token_id: int,
    video_token_id: int,
    merge: int,
    start: int = 0,
    text_prefix: int = 0,
) -> PromptLayout:
    """3-D positions of `token_ids`, whose image/video placeholder runs hold `visuals` in order.

    The first `text_prefix` tokens are text whatever their ids: tokens the model generated (a previous
    answer's unfed tail) are never placeholders, even when one equals the image or video token id."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
    if ids.dim() != 1:
        raise InvalidInputError(f"token ids must be one sequence, got shape {tuple(ids.shape)}")
    if start < 0:
        raise InvalidInputError(f"start position must be >= 0, got {start}")
    if not 0 <= text_prefix <= len(ids):
        raise InvalidInputError(f"text_prefix must be in [0, {len(ids)}], got {text_prefix}")
    types = torch.zeros_like(ids)
    types[ids == image_token_id] = _IMAGE
    types[ids == video_token_id] = _VIDEO
    types[:text_prefix] = _TEXT
    _check_counts(types, visuals, merge)

    pieces: list[torch.Tensor] = []
    spans: list[VisualSpan] = []
    span_parts: list[list[torch.Tensor]] = []
    pos = start
    next_visual = 0
    runs_left = 0  # temporal patches of the current video still to come
    for kind, s, e in _runs(types):
        n = e - s
        if kind == _TEXT:
            pieces.append(torch.arange(pos, pos + n).expand(3, n))
            pos += n
            continue
        name = _KIND_NAMES[kind]
        if runs_left and kind != _VIDEO:
            v = spans[-1]
            raise InvalidInputError(
                f"video {v.index} has {visuals[v.index].grid_thw[0]} temporal patches but only "
                f"{visuals[v.index].grid_thw[0] - runs_left} video token runs come before the image tokens "
                f"at token {s}"
            )
        if not runs_left:
            if next_visual >= len(visuals):
                raise InvalidInputError(f"the prompt has more {name} token runs than {name}s were given")
            visual = visuals[next_visual]
            if visual.kind != name:
                raise InvalidInputError(
                    f"visual {next_visual} is a {visual.kind}, but the next visual tokens in the prompt "
                    f"(at token {s}) are {name} tokens: visuals must be given in prompt order"
                )
            spans.append(VisualSpan(next_visual, visual.kind, torch.empty(0, dtype=torch.long)))
            span_parts.append([])
            runs_left = visual.grid_thw[0] if kind == _VIDEO else 1
            next_visual += 1
        visual = visuals[spans[-1].index]
        t, h, w = _merged_grid(visual, merge, spans[-1].index)
        if kind == _VIDEO:
            t = 1  # transformers splits a video into one (1, h, w) grid per temporal patch
        if n != t * h * w:
            where = f"temporal patch {visual.grid_thw[0] - runs_left} of " if kind == _VIDEO else ""
            raise InvalidInputError(
                f"{where}{name} {spans[-1].index} (grid {visual.grid_thw}) needs {t * h * w} {name} tokens "
                f"in a row, the prompt has a run of {n} at token {s}"
            )
        tt = torch.arange(t).view(t, 1, 1).expand(t, h, w)
        hh = torch.arange(h).view(1, h, 1).expand(t, h, w)
        ww = torch.arange(w).view(1, 1, w).expand(t, h, w)
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        span_parts[-1].append(torch.arange(s, e))
        pos += max(h, w)
        runs_left -= 1
    if runs_left:
        v = spans[-1]
        raise InvalidInputError(
            f"video {v.index} has {visuals[v.index].grid_thw[0]} temporal patches but the prompt has only "
            f"{visuals[v.index].grid_thw[0] - runs_left} video token runs"
        )
    if next_visual != len(visuals):
        raise InvalidInputError(f"{len(visuals)} visuals were given but the prompt holds only {next_visual}")

    for span, parts in zip(spans, span_parts, strict=True):
        span.token_indices = torch.cat(parts)
    positions = torch.cat(pieces, dim=1) if pieces else torch.empty(3, 0, dtype=torch.long)
    next_position = int(positions.max()) + 1 if positions.numel() else start
    return PromptLayout(positions.contiguous(), next_position, spans)


def _runs(types: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of equal type as (type, start, end); like transformers' itertools.groupby."""
    if types.numel() == 0:
        return []
    cuts = (torch.nonzero(types[1:] != types[:-1]).flatten() + 1).tolist()
    starts, ends = [0, *cuts], [*cuts, types.numel()]
    kinds = types[starts].tolist()
    return list(zip(kinds, starts, ends, strict=True))


def _merged_grid(visual: VisualInput, merge: int, index: int) -> tuple[int, int, int]:
    t, h, w = visual.grid_thw
    if min(t, h, w) <= 0 or h % merge or w % merge:
        raise InvalidInputError(
            f"{visual.kind} {index} grid {visual.grid_thw} must be positive with h, w divisible by {merge}"
        )
    return t, h // merge, w // merge


def _check_counts(types: torch.Tensor, visuals: Sequence[VisualInput], merge: int) -> None:
    """Token-count checks first: they give the clearest message for the common mistakes."""
    bad = [v.kind for v in visuals if v.kind not in ("image", "video")]
    if bad:
        raise InvalidInputError(f"unknown visual kind {bad[0]!r}; expected 'image' or 'video'")
    for code, name in _KIND_NAMES.items():
        have = int((types == code).sum())
        given = [(i, v) for i, v in enumerate(visuals) if v.kind == name]
        if not given and have:
            raise InvalidInputError(f"prompt has {have} {name} tokens but no {name} was given")
        if given and not have:
            raise InvalidInputError(f"{len(given)} {name}(s) given but the prompt has no {name} tokens")
        need = sum(_num_tokens(v, merge, i) for i, v in given)
        if need != have:
            grids = ", ".join(str(v.grid_thw) for _, v in given)
            raise InvalidInputError(
                f"prompt has {have} {name} tokens but the {len(given)} {name}(s) given need {need} "
                f"(grids {grids}, merge {merge})"
            )


def _num_tokens(visual: VisualInput, merge: int, index: int) -> int:
    t, h, w = _merged_grid(visual, merge, index)
    return t * h * w
