"""The Python side of the native Gated DeltaNet kernels (csrc/gated_deltanet.c, built and loaded by
ops/native.py): the buffers it writes (`GDNBuffers`), its calls prepared once per step over a step's
packed sequences as it reads them (`GDNKernel` over ops/gdn_sequences.py's `PackedSequences`), one-layer
calls (`gated_deltanet`; and `gated_deltanet_varlen` / `gated_deltanet_rows`, the native side of
ops/gdn_varlen.py's ops of those names, with their signatures) and the fold of tokens into affine state
maps (`fold_maps_`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import native
from .gdn_layout import VarlenLayout
from .gdn_sequences import PackedSequences

# packed rows from which a call splits its heads among torch's threads: a long prefill's; below, starting
# threads beside torch's own (which spin a while after each op) cost more than they save (a test file of
# short steps ran 25% slower at 64). A head's arithmetic is the same in any part: the bits do not depend on it
THREADED_ROWS = 256


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.float32 and t.is_contiguous() else t.float().contiguous()


def _blocks_of(t: torch.Tensor, inner: int) -> bool:
    """fp32 on the CPU, and each block of the last `inner` dims contiguous (a pool, whose blocks lie any
    distance apart, or a layer's view of one)."""
    if t.dtype is not torch.float32 or t.device.type != "cpu":
        return False
    expected = 1
    for size, stride in zip(reversed(t.shape[-inner:]), reversed(t.stride()[-inner:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@dataclass
class GDNBuffers:
    """What the GDN kernel writes for one group of sequences, every layer's rows side by side (`[rows,
    layers, ...]`, fp32): the update then writes all layers' new states of a row with one copy."""

    # the rows of the states that do not go straight into the pool (`PackedSequences.out_row`)
    finals: torch.Tensor                  # [N, L, H, Dk, Dv] state after each sequence
    tails: torch.Tensor                   # [N, L, K-1, C] conv history after each sequence
    split_states: torch.Tensor | None     # [S, L, H, Dk, Dv] … after the first split_row rows
    split_tails: torch.Tensor | None      # [S, L, K-1, C]
    corrected: torch.Tensor | None        # [J, L, H, Dk, Dv] the joins' corrected live states

    @classmethod
    def empty(cls, seqs: PackedSequences, layers: int, hist_shape: tuple[int, ...], state_shape: tuple[int, ...],
              device: torch.device | str = "cpu") -> GDNBuffers:
        def new(rows: int, shape: tuple[int, ...]) -> torch.Tensor:
            return torch.empty(rows, layers, *shape, dtype=torch.float32, device=device)
        return cls(new(seqs.buffered, state_shape), new(seqs.buffered, hist_shape),
                   new(seqs.split_buffered, state_shape) if seqs.split_buffered else None,
                   new(seqs.split_buffered, hist_shape) if seqs.split_buffered else None,
                   new(seqs.joins, state_shape) if seqs.joins else None)

    def layer(self, i: int) -> tuple[torch.Tensor | None, ...]:
        """Layer i's (finals, split states, tails, split tails, corrected), views."""
        return tuple(None if t is None else t[:, i] for t in (self.finals, self.split_states, self.tails,
                                                                self.split_tails, self.corrected))

    def split(self, n: int) -> tuple[GDNBuffers, GDNBuffers]:
        """The first n buffer rows (the first group's, with every split and join, which only it has) and
        the rest, as views."""
        return (GDNBuffers(self.finals[:n], self.tails[:n], self.split_states, self.split_tails, self.corrected),
                GDNBuffers(self.finals[n:], self.tails[n:], None, None, None))

    def store(self, i: int, finals: torch.Tensor, split_states: torch.Tensor | None, tails: torch.Tensor,
              split_tails: torch.Tensor | None, corrected: torch.Tensor | None) -> None:
        """Layer i's results computed elsewhere (the torch path) into the buffers."""
        for buf, t in zip((self.finals, self.split_states, self.tails, self.split_tails, self.corrected),
                          (finals, split_states, tails, split_tails, corrected), strict=True):
            if buf is not None:
                buf[:, i] = t


_LAYER_POINTERS = ("xu", "xg", "xb", "hist", "state_in", "seed_state", "seed_hist", "p", "s_ref", "state_out",
                   "split_out", "tails", "split_tails", "corrected")
_SEQUENCE_POINTERS = ("source", "start", "len", "split_row", "split_index", "slot", "seed_state_at",
                      "seed_hist_at", "join_seq", "live_slot", "out_row", "split_out_row")


class GDNArgs(ctypes.Structure):
    """csrc/gated_deltanet.c's `gdn_args`, field by field: what one call of the kernel reads and writes."""

    _fields_ = [("u", ctypes.c_void_p), ("ld_u", ctypes.c_int64),
                *((name, ctypes.c_void_p) for name in ("g", "beta", "conv_w", "o", "x_out", *_LAYER_POINTERS,
                                                       *_SEQUENCE_POINTERS)),
                *((name, ctypes.c_int64) for name in (
                    "n", "joins", "joins_after", "hist_stride", "state_stride", "seed_state_stride",
                    "seed_hist_stride", "p_stride", "ref_stride", "out_state_stride", "out_hist_stride", "kernel",
                    "key_heads", "heads", "dk", "dv")),
                *((name, ctypes.c_void_p) for name in ("cap_first", "cap_row", "cap_state", "cap_hist")),
                ("cap_state_stride", ctypes.c_int64), ("cap_hist_stride", ctypes.c_int64), ("threads", ctypes.c_int64)]


class GDNKernel:
    """One step's calls of the native GDN kernel (csrc/gated_deltanet.c) over one group of packed
    sequences, one call per layer. What the layers share is checked and laid out once: the sequences,
    the pools' rows `conv_pool [rows, L, K-1, C]` and `ssm_pool [rows, L, H, Dk, Dv]` (read in place, and
    written in place where the sequences name a pool row for their new state: `PackedSequences.out_row`),
    the appended rows `extra` = (u `[L, T, C]`, g, beta `[L, T, H]`), the joins' `maps` = (P `[J, L, H, Dk,
    Dk]`, S_lead `[J, L, H, Dk, Dv]`), the `seeds` = (histories `[M, L, K-1, C]`, states
    `[M', L, H, Dk, Dv]`) sequences may start from, and the output buffers; a layer's part of each is
    found by pointer arithmetic, so a layer's call passes only its own rows (its wrapper was ~40 µs of
    checks and allocations per layer, more than the kernel at one row). `captures` = (first `[N + 1]`, rows
    `[M]`, histories `[M, L, K-1, C]`, states `[M, L, H, Dk, Dv]`): the history and state after packed row
    `rows[m]` of sequence s, for m in `[first[s], first[s + 1])` (ascending), go to row m of the latter two
    (states at chosen rows, ops/gdn_rows.py)."""

    def __init__(self, seqs: PackedSequences, conv_pool: torch.Tensor, ssm_pool: torch.Tensor, key_heads: int,
                 out: GDNBuffers, extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 maps: tuple[torch.Tensor, torch.Tensor] | None = None,
                 seeds: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                 captures: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        lib = native.loaded("gated_deltanet")
        if lib is None:
            raise RuntimeError("the Gated DeltaNet kernel is not available (see ops/backend.py select)")
        self._fn = lib.gated_deltanet_f32
        if not (_blocks_of(conv_pool, 2) and _blocks_of(ssm_pool, 3)) or conv_pool.shape[1] != ssm_pool.shape[1]:
            raise ValueError("gated_deltanet reads fp32 CPU pools [slots, layers, ...] whose blocks are contiguous")
        self.layers, (heads, dk, dv), hist_shape = ssm_pool.shape[1], ssm_pool.shape[2:], conv_pool.shape[2:]
        self.seqs, self.key_heads, self.heads, self.dk, self.dv = seqs, key_heads, heads, dk, dv
        self.channels, self.kernel = hist_shape[1], hist_shape[0] + 1
        layers = self.layers
        if seqs.slots_needed > min(conv_pool.shape[0], ssm_pool.shape[0]) or heads % (key_heads or 1) \
                or self.channels != 2 * key_heads * dk + heads * dv:
            raise ValueError("gated_deltanet: slots, channels or heads do not match")
        xu, xg, xb = extra if extra is not None else (None, None, None)
        if seqs.appended and (xu is None or any(
                not t.is_contiguous() or t.dtype != torch.float32 or t.shape[0] != layers or t.shape[1] < seqs.appended
                for t in (xu, xg, xb)) or xu.shape[2] != self.channels or xg.shape[2] != heads
                or xb.shape[2] != heads):
            raise ValueError("gated_deltanet: appended rows do not match (contiguous fp32 [layers, rows, ...], as "
                             "many rows as the sequences read)")
        p = s_ref = None
        if seqs.joins:
            if maps is None:
                raise ValueError("gated_deltanet: joins need their maps (P, S_lead)")
            p, s_ref = maps
            if not (_blocks_of(p, 3) and _blocks_of(s_ref, 3)) or p.shape != (seqs.joins, layers, heads, dk, dk) \
                    or s_ref.shape != (seqs.joins, layers, heads, dk, dv):
                raise ValueError("gated_deltanet: P must be [J, L, H, Dk, Dk] and S_lead [J, L, H, Dk, Dv], fp32")
        seed_hist, seed_state = seeds
        for seed, needed, shape, inner in ((seed_hist, seqs.seed_hists_needed, hist_shape, 2),
                                           (seed_state, seqs.seed_states_needed, ssm_pool.shape[2:], 3)):
            if needed and (seed is None or not _blocks_of(seed, inner) or seed.shape[0] < needed
                           or seed.shape[1:] != (layers, *shape)):
                raise ValueError("gated_deltanet: seed rows, or their shapes, do not match")
        for buf, rows, shape in ((out.finals, seqs.buffered, ssm_pool.shape[2:]),
                                 (out.tails, seqs.buffered, hist_shape),
                                 (out.split_states, seqs.split_buffered, ssm_pool.shape[2:]),
                                 (out.split_tails, seqs.split_buffered, hist_shape),
                                 (out.corrected, seqs.joins, ssm_pool.shape[2:])):
            if rows and (buf is None or not buf.is_contiguous() or buf.dtype != torch.float32
                         or buf.shape != (rows, layers, *shape)):
                raise ValueError("gated_deltanet: output buffers must be contiguous fp32 [rows, layers, ...]")
        cap_first, cap_row, cap_hist, cap_state = captures if captures is not None else (None,) * 4
        if captures is not None and (
                cap_first.dtype != torch.long or not cap_first.is_contiguous() or cap_first.shape != (seqs.count + 1,)
                or cap_row.dtype != torch.long or not cap_row.is_contiguous() or cap_row.shape[0] != int(cap_first[-1])
                or any(not t.is_contiguous() or t.dtype != torch.float32 for t in (cap_hist, cap_state))
                or cap_hist.shape != (cap_row.shape[0], layers, *hist_shape)
                or cap_state.shape != (cap_row.shape[0], layers, *ssm_pool.shape[2:])):
            raise ValueError("gated_deltanet: captures are int64 first [N + 1] and rows [M], contiguous fp32 "
                             "histories and states [M, layers, ...]")
        self.out = out
        # the tensors the struct points into live as long as the kernel (some may be copies made here)
        self._operands = (conv_pool, ssm_pool, xu, xg, xb, p, s_ref, seed_hist, seed_state, captures)
        args = self._args = GDNArgs(
            threads=torch.get_num_threads() if seqs.source.shape[0] >= THREADED_ROWS else 1,
            n=seqs.count, joins=seqs.joins, joins_after=seqs.joins_after, hist_stride=conv_pool.stride(0),
            state_stride=ssm_pool.stride(0), out_state_stride=out.finals.stride(0),
            out_hist_stride=out.tails.stride(0), kernel=self.kernel, key_heads=key_heads, heads=heads, dk=dk, dv=dv,
            **{name: t.stride(0) for name, t in (("seed_state_stride", seed_state), ("seed_hist_stride", seed_hist),
                                                 ("p_stride", p), ("ref_stride", s_ref),
                                                 ("cap_state_stride", cap_state), ("cap_hist_stride", cap_hist))
               if t is not None},
            **{name: t.data_ptr() for name, t in (("cap_first", cap_first), ("cap_row", cap_row)) if t is not None},
            **{name: t.data_ptr() for name, t in zip(_SEQUENCE_POINTERS, (
                seqs.source, seqs.seq_start, seqs.seq_len, seqs.split_row, seqs.split_index, seqs.slot,
                seqs.seed_state_at, seqs.seed_hist_at, seqs.join_seq, seqs.join_live, seqs.out_row,
                seqs.split_out_row), strict=True) if t is not None})
        self._address = ctypes.addressof(args)
        # what each call sets: (field, base pointer, bytes from one layer's part to the next) of each shared
        # tensor there is (the others stay NULL)
        self._layered = [(name, t.data_ptr(), t.stride(dim) * t.element_size())
                         for name, t, dim in zip((*_LAYER_POINTERS, "cap_state", "cap_hist"), (
                             xu, xg, xb, conv_pool, ssm_pool, seed_state, seed_hist, p, s_ref, out.finals,
                             out.split_states, out.tails, out.split_tails, out.corrected, cap_state, cap_hist),
                             (0, 0, 0, *[1] * 13), strict=True) if t is not None]

    def __call__(self, layer: int, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                 out: torch.Tensor, x_out: torch.Tensor | None = None) -> None:
        """Layer `layer`: packed row r is row `source[r]` of the step's pre-conv rows `u [R, C]` (rows may
        be strided) and gates `g, beta [R, H]`, its output row `source[r]` of `out [R, H, Dv]`; `x_out
        [R, C]`, if given, receives each step row's [q | k | v] as the delta rule read them."""
        seqs, heads = self.seqs, self.heads
        g, beta, w = _f32(g), _f32(beta), _f32(conv_weight)
        if (u.dtype != torch.float32 or u.device.type != "cpu" or u.stride(-1) != 1 or u.shape[-1] != self.channels
                or not out.is_contiguous() or out.dtype != torch.float32 or out.shape[1:] != (heads, self.dv)
                or g.shape[-1] != heads or beta.shape[-1] != heads or w.shape != (self.channels, self.kernel)
                or seqs.step_rows_needed > min(u.shape[0], out.shape[0], g.shape[0], beta.shape[0])
                or not 0 <= layer < self.layers):
            raise ValueError("gated_deltanet: a layer's rows, gates, output or conv weight do not match")
        if x_out is not None and (not x_out.is_contiguous() or x_out.dtype != torch.float32
                                  or x_out.shape[0] < seqs.step_rows_needed or x_out.shape[1:] != (self.channels,)):
            raise ValueError("gated_deltanet: x_out must be a contiguous fp32 [rows, C]")
        args = self._args
        args.u, args.ld_u, args.g, args.beta, args.conv_w, args.o = (u.data_ptr(), u.stride(0), g.data_ptr(),
                                                                     beta.data_ptr(), w.data_ptr(), out.data_ptr())
        args.x_out = None if x_out is None else x_out.data_ptr()
        for name, base, step in self._layered:
            setattr(args, name, base + layer * step)
        status = self._fn(self._address)
        if status != 0:
            raise MemoryError("gated_deltanet: cannot allocate its scratch buffer")


def fold_maps_(p: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> bool:
    """Append tokens to the maps `p [..., Dk, Dk]` in place (csrc/gated_deltanet.c `fold_maps_f32`): k
    `[T, M, Dk]`, g and beta `[T, M]` for its M maps. False, with `p` untouched, where the kernel does
    not apply (not fp32 on the CPU, `p` not contiguous, or no kernel)."""
    if not (p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous()
            and native.gated_deltanet_available(p.device, p.dtype)):
        return False
    lib = native.loaded("gated_deltanet")
    dk = p.shape[-1]
    maps = p.numel() // (dk * dk)
    k, g, beta = _f32(k), _f32(g), _f32(beta)
    n = k.shape[0]
    if k.shape != (n, maps, dk) or g.shape != (n, maps) or beta.shape != (n, maps):
        raise ValueError(f"fold_maps_: k [T, {maps}, {dk}], g and beta [T, {maps}] for {maps} maps")
    lib.fold_maps_f32(p.data_ptr(), maps, dk, k.data_ptr(), g.data_ptr(), beta.data_ptr(), n)
    return True


def gated_deltanet(u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, conv_weight: torch.Tensor,
                   conv_pool: torch.Tensor, ssm_pool: torch.Tensor, key_heads: int, seqs: PackedSequences,
                   out: torch.Tensor, maps: tuple[torch.Tensor, torch.Tensor] | None = None,
                   seeds: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                   x_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """One layer through the kernel (`GDNKernel` of a one-layer pool): short convolution, SiLU, q/k
    normalisation and the delta rule over packed sequences, then the joins. Pools `conv_pool [slots, K-1,
    C]`, `ssm_pool [slots, H, Dk, Dv]` (a layer's views of the engine's pools), `extra` = (u `[T, C]`, g,
    beta `[T, H]`), `maps` = (P `[J, H, Dk, Dk]`, S_lead `[J, H, Dk, Dv]`), `seeds` = (histories `[M, K-1,
    C]`, states `[M', H, Dk, Dv]`); the rest as `GDNKernel.__call__`. Returns (final states, states at the
    splits or None, histories after each sequence `[N, K-1, C]`, histories at the splits or None,
    corrected live states `[J, H, Dk, Dv]` or None), fp32."""
    if conv_pool.dim() != 3 or ssm_pool.dim() != 4:
        raise ValueError("gated_deltanet: pools [slots, K-1, C] and [slots, H, Dk, Dv]")
    buffers = GDNBuffers.empty(seqs, 1, tuple(conv_pool.shape[1:]), tuple(ssm_pool.shape[1:]))
    kernel = GDNKernel(seqs, conv_pool.unsqueeze(1), ssm_pool.unsqueeze(1), key_heads, buffers,
                       extra=None if extra is None else tuple(_f32(t).unsqueeze(0) for t in extra),
                       maps=None if maps is None else tuple(t.unsqueeze(1) for t in maps),
                       seeds=tuple(None if t is None else _f32(t).unsqueeze(1) for t in seeds))
    kernel(0, u, g, beta, conv_weight, out, x_out)
    return buffers.layer(0)


def gated_deltanet_varlen(u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, conv_weight: torch.Tensor,
                          conv_pool: torch.Tensor, ssm_pool: torch.Tensor, layout: VarlenLayout, key_heads: int,
                          key_dim: int, out: torch.Tensor, maps: tuple[torch.Tensor, torch.Tensor] | None = None,
                          ) -> tuple[torch.Tensor | None, ...]:
    """ops/gdn_varlen.py `gated_deltanet_varlen` (same arguments and results) through the kernel."""
    return gated_deltanet(u, g, beta, extra, conv_weight, conv_pool, ssm_pool, key_heads, layout.seqs, out, maps)


def gated_deltanet_rows(u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                        conv_pool: torch.Tensor, ssm_pool: torch.Tensor, layout: VarlenLayout, key_heads: int,
                        key_dim: int, out: torch.Tensor,
                        seeds: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None), factors: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """ops/gdn_varlen.py `gated_deltanet_rows` (same arguments and results) through the kernel: one call
    instead of the torch path's ~30 small ops. The factors are sliced from each step row's [q | k | v] as
    the delta rule read them."""
    x_out = u.new_empty(u.shape[0], u.shape[1]) if factors else None
    finals, _, tails, _, _ = gated_deltanet(u, g, beta, None, conv_weight, conv_pool, ssm_pool, key_heads,
                                            layout.seqs, out, None, seeds, x_out)
    if x_out is None:
        return tails, finals, None
    rows = layout.step_rows(x_out.shape[0])
    x = x_out if rows is None else x_out[rows]
    kd = key_heads * key_dim
    k, v = x[:, kd:2 * kd].view(-1, key_heads, key_dim), x[:, 2 * kd:].view(x.shape[0], ssm_pool.shape[1], -1)
    return tails, finals, (k, v)
