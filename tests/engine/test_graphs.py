"""Bucketed decode steps (engine/padding.py) and the graph path (engine/graphs.py) on the CPU: a decode
step padded to its bucket (decode rows to a power of two, each session's fused chunk to 0/7/15/31/63
rows) and run over the static buffers of the first step of its skeleton — eagerly, where CUDA replays a
captured graph — gives the logits the unpadded step gives, for both families and every chunk bucket."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.graphs import copy_into, leaves, skeleton, values
from raincheck_core.engine.padding import CHUNK_BUCKETS, Bucket, Scratch, bucket_of, pad
from raincheck_core.engine.plan import Kind, Segment, StepPlan
from tests.deferral.helpers import image_prompt

GRID = (1, 16, 24)      # 96 visual tokens: at r = 0.3, 67 deferred rows, enough for a chunk of 63


def _engine(folder, graphs: bool) -> Engine:
    engine = Engine.from_pretrained(folder, backend="flex", deferred_budget=4096)
    if graphs:
        engine.core.runner.use_graphs(capture=False)
    return engine


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    return {f: (_engine(folder, False), _engine(folder, True)) for f, (_, folder) in tiny_checkpoints.items()}


def _turns(engine: Engine, chunk: int) -> tuple[list[torch.Tensor], list[Bucket | None]]:
    """Three sessions at once (a decode bucket of 4: one padding decode row), one deferring with chunks
    of `chunk` rows (0: no deferral); each session's logits, and the bucket of every step."""
    buckets: list[Bucket | None] = []
    remove = engine.on_plan(lambda plan: buckets.append(bucket_of(plan)))
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=1, chunk_size=chunk) if chunk \
        else DeferralConfig("full")
    sessions = [engine.open_session() for _ in range(3)]
    streams = [s.turn(image_prompt(engine, seed=10 + i, grid=GRID), SamplingParams(max_new_tokens=6, ignore_eos=True),
                      deferral=cfg if i == 0 else DeferralConfig("full"), return_logits=True)
               for i, s in enumerate(sessions)]
    while not all(st.request.finished for st in streams):
        engine.step()
    remove()
    logits = [torch.stack([e.logits for e in st.tokens()]) for st in streams]
    for s in sessions:
        s.close()
    return logits, buckets


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("chunk", CHUNK_BUCKETS)
def test_padded_decode_steps_equal_unpadded(engines, family, chunk):
    plain, padded = engines[family]
    graphs = padded.core.runner.graphs
    replays = graphs.replays
    want, _ = _turns(plain, chunk)
    got, buckets = _turns(padded, chunk)
    assert Bucket(4, chunk) in buckets                   # a step of this chunk bucket ran padded
    assert graphs.replays - replays >= 4
    for x, y in zip(want, got, strict=True):
        assert torch.equal(x.argmax(-1), y.argmax(-1))
        assert float((x - y).abs().max()) <= 1e-5


def test_replays_reuse_static_buffers(engines):
    """Decode steps of one shape share one static step: far fewer skeletons than replays (a full-attention
    model's decode steps differ only in tensor contents once their keys fit one bucket)."""
    graphs = engines["qwen3_vl"][1].core.runner.graphs
    assert len(graphs.graphs) < graphs.replays


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_plain_decode_steps_of_a_bucket_share_one_skeleton(engines, family):
    """A decode step changes each session's length by one: its layout's tensors change contents, not shape,
    and nothing that grows with the context (the attention layout's per-segment key counts) may enter the
    skeleton, or every step would be captured anew."""
    graphs = engines[family][1].core.runner.graphs
    before, replays = set(graphs.graphs), graphs.replays
    _turns(engines[family][1], 0)
    assert graphs.replays - replays >= 4
    assert len([key for key in set(graphs.graphs) - before if key[0] == Bucket(4, 0)]) <= 1


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_fused_decode_steps_of_a_bucket_share_its_skeletons(engines, family):
    """A padded step's shapes are its bucket's: a session's last chunk, shorter than the bucket's rows, runs
    as every other chunk of the bucket (its fill attended by none and idle in its GDN sequence), and a
    joined chunk's conv lead takes kernel - 1 rows whatever the turn has generated. What is left for the
    hybrid is whether a decode row starts from its joined chunk's conv history (within its turn's lead)
    or from its own: one skeleton per chunk bucket, two for the hybrid."""
    graphs = engines[family][1].core.runner.graphs
    replays = graphs.replays
    for chunk in CHUNK_BUCKETS[1:-1]:
        _, buckets = _turns(engines[family][1], chunk)
        assert Bucket(4, chunk) in buckets
    assert graphs.replays - replays >= 12
    for chunk in CHUNK_BUCKETS[1:-1]:
        skeletons = [key for key in graphs.graphs if key[0] == Bucket(4, chunk)]
        assert 1 <= len(skeletons) <= (2 if family == "qwen3_5" else 1)


def test_a_failed_capture_runs_the_step_eagerly(engines, tiny_checkpoints, monkeypatch):
    """A capture that raises part-way (an op that cannot be captured) has run some of the forward over the
    step's batch: the runner prepares the step again and runs it eagerly, as every later step of that
    skeleton, with the results of the unpadded step."""
    engine = _engine(tiny_checkpoints["qwen3_5"][1], graphs=True)
    graphs = engine.core.runner.graphs

    def fails(batch):
        with torch.inference_mode():
            graphs.model(batch)     # the warm-up ran: the batch's GDN outputs hold its factors
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", fails)
    want, _ = _turns(engines["qwen3_5"][0], 7)
    got, buckets = _turns(engine, 7)
    assert Bucket(4, 7) in buckets
    assert graphs.graphs and all(g is None for g in graphs.graphs.values()) and graphs.replays == 0
    for x, y in zip(want, got, strict=True):
        assert torch.equal(x.argmax(-1), y.argmax(-1))
        assert float((x - y).abs().max()) <= 1e-5


def _segment(kind: Kind, session: str, rows: int) -> Segment:
    slots = torch.arange(rows)
    return Segment(kind, session, rows, slots, slots, None)


def test_buckets_and_padding():
    decode, chunk = _segment(Kind.DECODE, "a", 1), _segment(Kind.DEFERRED, "a", 9)
    plan = StepPlan([decode, chunk, _segment(Kind.DECODE, "b", 1), _segment(Kind.DECODE, "c", 1)])
    bucket = bucket_of(plan)
    assert bucket == Bucket(4, 15)
    scratch = _scratch()
    result = pad(plan, bucket, scratch)
    padded = result.plan
    assert padded.rows == bucket.rows == 64
    assert padded.segments[:4] == plan.segments
    fill = [s.rows for s in padded.segments[4:]]
    assert fill == [6, 15, 15, 1, 15]                    # a's chunk to 15, b's and c's, a fourth decode row
    assert all(s.kind is Kind.PADDING and not s.sample for s in padded.segments[4:])
    assert all(bool((s.write_slots == scratch.kv_slot).all()) for s in padded.segments[4:])
    # a's fill runs in a's GDN sequence; padding rows are attended by none; groups of four decode rows
    # and four chunks of up to 16 rows
    assert result.fills == {1: 4}
    assert result.groups.query == [1, 16, 1, 1, 0, 0, 0, 0, 0]
    assert result.groups.size == {1: 4, 16: 4}
    assert bucket_of(StepPlan([_segment(Kind.PREFILL, "a", 5)])) is None          # prefill stays eager
    assert bucket_of(StepPlan([decode, _segment(Kind.DEFERRED, "a", 64)])) is None   # past the largest chunk
    assert bucket_of(StepPlan([decode, chunk, _segment(Kind.DEFERRED, "a", 3)])) is None
    assert bucket_of(StepPlan([decode, _segment(Kind.DEFERRED, "z", 3)])) is None    # a chunk of no decoding session
    assert bucket_of(StepPlan([_segment(Kind.DEFERRED, "a", 3)])) is None and bucket_of(StepPlan()) is None


def _scratch() -> Scratch:
    return Scratch(torch.tensor([99]), None)


def test_skeleton_and_copy():
    """Same shapes and plain values: one skeleton, and copying moves every tensor's contents."""
    a = StepPlan([_segment(Kind.DECODE, "a", 1)])
    b = StepPlan([Segment(Kind.DECODE, "a", 1, torch.tensor([7]), torch.tensor([7]), None)])
    assert skeleton(a.segments[0]) == skeleton(b.segments[0])
    assert skeleton(a.segments[0]) != skeleton(_segment(Kind.DECODE, "a", 2))
    copy_into(values(a.segments[0]), leaves(b.segments[0]))
    assert int(a.segments[0].write_slots) == 7


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_a_decode_steps_host_tensors_go_in_one_copy(engines, family):
    """On the GPU path (here its CPU twin, eager and padded) every tensor a decode step builds on the host —
    the attention layout and its table writes, the layout parts the GDN ops read, positions, logit rows, the
    answer rows' token ids — is staged and sent in one copy (ops/uploads.py), steps with fused chunks too:
    none is copied on its own where the forward first reads it. A step larger than any before takes one
    staging block more: the turns run once before, to size the buffers."""
    for engine in engines[family]:
        up = engine.core.runner.uploads
        _turns(engine, 15)
        seen: list[tuple[set[Kind], int]] = []

        def record(plan: StepPlan, up=up, seen=seen) -> None:
            seen.append(({s.kind for s in plan.segments}, up.copies))
        remove = engine.on_read(record)
        _turns(engine, 15)
        remove()
        decoding = [(kinds, copies) for kinds, copies in seen
                    if Kind.DECODE in kinds and kinds <= {Kind.DECODE, Kind.DEFERRED, Kind.PADDING}]
        assert any(Kind.DEFERRED in kinds for kinds, _ in decoding)
        assert all(copies == 1 for _, copies in decoding), decoding
