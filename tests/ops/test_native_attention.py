"""The native paged-attention kernel (ops/csrc/paged_attention.c) against the fp32 reference, and its
fallback: a machine that cannot build it runs the torch path."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.ops import backend, gdn_kernel, gdn_sequences, native
from raincheck_core.ops.attention import reference_attention
from raincheck_core.ops.paged_attention import paged_attention, paged_segments

needs_kernel = pytest.mark.skipif(not native.paged_attention_available("cpu", torch.float32),
                                  reason="the native kernel cannot be built here (no C compiler)")


def _paged_reads(q_lens: list[int], pasts: list[int], slots: int, page: int, gen: torch.Generator
                 ) -> list[torch.Tensor]:
    """Each segment's readable slots: whole pages in a random order, as the pool hands them out to
    sessions that grew side by side."""
    order = (torch.randperm(slots // page, generator=gen)[:, None] * page + torch.arange(page)).flatten()
    reads, at = [], 0
    for n, past in zip(q_lens, pasts, strict=True):
        reads.append(order[at:at + past + n])
        at += past + n
    return reads


@needs_kernel
@pytest.mark.parametrize("heads, kv, d", [(6, 2, 16), (4, 4, 64), (8, 1, 32), (4, 2, 24)])
def test_kernel_equals_the_reference_for_every_segment(heads, kv, d):
    """Decode rows and multi-row segments (bottom-right causal), contexts shorter and longer than the
    kernel's 256-key block (the running softmax rescales), grouped-query heads (a group's rows fill its
    register tiles partly), head sizes that are and are not whole 16-float tiles."""
    gen = torch.Generator().manual_seed(heads * d)
    slots, page = 4096, 16
    k_cache, v_cache = torch.randn(slots, kv, d, generator=gen), torch.randn(slots, kv, d, generator=gen)
    q_lens, pasts = [1, 7, 1, 31, 1, 64, 2], [0, 300, 700, 600, 255, 40, 257]
    reads = _paged_reads(q_lens, pasts, slots, page, gen)
    starts = [sum(q_lens[:s]) for s in range(len(q_lens))]
    # large logits: a later block's max exceeds an earlier one's, so the accumulators are rescaled
    q = 4 * torch.randn(sum(q_lens), heads, d, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, out, paged_segments(list(range(len(q_lens))), q_lens, starts, reads))
    for s, (n, at) in enumerate(zip(q_lens, starts, strict=True)):
        ref = reference_attention(q[at:at + n], k_cache, v_cache, reads[s])
        assert float((out[at:at + n] - ref).abs().max()) <= 1e-5, s


@needs_kernel
@pytest.mark.parametrize("rows", [2, 3, 4])
def test_a_verify_segments_rows_have_the_bits_of_decode_rows(rows):
    """Row i of a segment of up to 4 rows (a verify segment at k <= 3) gives exactly what a decode row over
    the same keys gives: speculation's kept rows then match plain decoding's bit for bit."""
    gen = torch.Generator().manual_seed(rows)
    heads, kv, d = 8, 2, 64
    k_cache, v_cache = torch.randn(2048, kv, d, generator=gen), torch.randn(2048, kv, d, generator=gen)
    read = _paged_reads([rows], [600], 2048, 16, gen)[0]
    q = 4 * torch.randn(rows, heads, d, generator=gen)
    out = torch.empty_like(q)
    paged_attention(q, k_cache, v_cache, out, paged_segments([0], [rows], [0], [read]))
    for i in range(rows):
        alone = torch.empty_like(q[i:i + 1])
        keys = read[:len(read) - rows + i + 1]
        paged_attention(q[i:i + 1].contiguous(), k_cache, v_cache, alone, paged_segments([0], [1], [0], [keys]))
        assert torch.equal(out[i:i + 1], alone), i


@needs_kernel
def test_kernel_writes_only_its_segments_rows_and_checks_its_inputs():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(64, 2, 16, generator=gen), torch.randn(64, 2, 16, generator=gen)
    q = torch.randn(3, 6, 16, generator=gen)
    out = torch.zeros_like(q)
    seg = paged_segments([1], [1, 1, 1], [0, 1, 2], [torch.arange(5), torch.arange(5, 20), torch.arange(3)])
    paged_attention(q, k_cache, v_cache, out, seg)
    assert bool((out[[0, 2]] == 0).all())
    assert float((out[1] - reference_attention(q[1:2], k_cache, v_cache, torch.arange(5, 20))[0]).abs().max()) <= 1e-5
    with pytest.raises(ValueError, match="contiguous fp32"):
        paged_attention(q.double(), k_cache, v_cache, out, seg)
    # the kernel reads without bounds checks: a slot past the cache is refused before it runs
    beyond = paged_segments([0], [1], [0], [torch.tensor([3, 64])])
    with pytest.raises(ValueError, match="slots up to 64 in a cache of 64"):
        paged_attention(q, k_cache, v_cache, out, beyond)


@pytest.mark.skipif(not native.gated_deltanet_available("cpu", torch.float32), reason="no C compiler")
def test_gdn_kernel_refuses_rows_it_would_read_out_of_bounds():
    channels, heads, d = 2 * 2 * 8 + 4 * 8, 4, 8
    u, g, beta = torch.randn(5, channels), torch.rand(5, heads), torch.rand(5, heads)
    args = (torch.randn(channels, 4), torch.randn(1, 3, channels), torch.zeros(1, heads, d, d), 2)
    out = torch.empty(5, heads, d)
    gdn_kernel.gated_deltanet(u, g, beta, None, *args, gdn_sequences.packed_sequences([5], [None], None), out)
    for source in (torch.arange(1, 6), torch.tensor([0, 1, 2, 3, -1])):    # a row past u; an appended row, none given
        with pytest.raises(ValueError, match="do not match"):
            gdn_kernel.gated_deltanet(u, g, beta, None, *args, gdn_sequences.packed_sequences([5], [None], source), out)
    # a slot past the one-slot pools, as a sequence's start or as a join's live state
    for seqs in (gdn_sequences.packed_sequences([5], [None], None, slots=[1]),
                 gdn_sequences.packed_sequences([5], [None], None, joins=[(0, 1)])):
        with pytest.raises(ValueError, match="do not match"):
            gdn_kernel.gated_deltanet(u, g, beta, None, *args, seqs, out, (torch.zeros(1, heads, d, d),) * 2)


def test_without_a_compiler_the_layout_takes_the_torch_path(monkeypatch, tmp_path, caplog):
    """A failed build is logged once and the step runs the batched torch path, with the same result."""
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.setenv("RAINCHECK_NATIVE", "1")
    monkeypatch.setenv("RAINCHECK_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with caplog.at_level("WARNING"):
        ops = backend.select("cpu", torch.float32, torch.float32, None)
    assert ops.attention.name == "torch" and "no C compiler" in caplog.text
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache = torch.randn(32, 2, 16, generator=gen), torch.randn(32, 2, 16, generator=gen)
    q, k, v = torch.randn(2, 6, 16, generator=gen), torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16)
    reads = [torch.arange(0, 9), torch.arange(9, 20)]
    layout = ops.attention.layout([1, 1], reads, torch.tensor([8, 19]), "cpu")
    assert layout.paged is None
    out = ops.attention.attend(q, k, v, k_cache, v_cache, layout)
    for s in range(2):
        assert float((out[s:s + 1] - reference_attention(q[s:s + 1], k_cache, v_cache, reads[s])).abs().max()) <= 1e-5


@needs_kernel
def test_a_read_only_cache_folder_falls_back_to_the_temporary_folder(monkeypatch, tmp_path):
    """A container with a read-only root file system (the k8s manifests) still gets the kernel."""
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.delenv("RAINCHECK_NATIVE_CACHE", raising=False)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(native.tempfile, "tempdir", str(tmp_path))
    assert native.library("paged_attention") is not None
    assert list(tmp_path.glob("raincheck-native-*/paged_attention-*.so"))


@needs_kernel
def test_a_library_in_a_folder_of_another_user_is_never_loaded(monkeypatch, tmp_path):
    """The temporary folder's name is predictable: a folder someone else owns is refused."""
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.setenv("RAINCHECK_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native.os, "getuid", lambda: tmp_path.stat().st_uid + 1)
    assert native.library("paged_attention") is None
    assert not list(tmp_path.glob("*.so"))


def test_native_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("RAINCHECK_NATIVE", "0")
    assert native.library("paged_attention") is None
    ops = backend.select("cpu", torch.float32, torch.float32, (torch.float32, torch.float32))
    assert (ops.attention.name, ops.gdn.name) == ("torch", "torch")
    assert ops.attention.layout([1], [torch.arange(4)], torch.tensor([3]), "cpu").paged is None
    assert not native.paged_attention_available("cpu", torch.float64)
