"""Speculative decoding on the hybrid family (Qwen3.5) while a GDN join is pending (docs/mechanism.md §13):
a verify segment is tracked, and only its kept rows extend the join. Every token's logits equal an exact
reference over the rows of the speculative run's own schedule (verify steps while the join is pending,
rejected drafts included); a join's P_rest, lead and S_lead after verify steps that rejected drafts equal
those of plain decoding; deferred rows never read a draft or rejected slot (checked as the steps are
planned); a verify segment and a chunk of its own session never share a step. With rejected rows fed to
the join both fail (the identity by 2e-2 on this model's slow decays)."""

from __future__ import annotations

import itertools

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.plan import Kind, StepPlan
from raincheck_core.speculative.config import SpeculativeConfig
from tests.deferral.cross_turn import Row, RowLog, reference
from tests.deferral.helpers import image_prompt, on_join_release, slow_decays, two_attention_hybrid

TOL = 1e-5
# the native kernel copies a verify segment's states out as it passes; the chunked rules replay them (§5.8)
BACKENDS = ["native", "torch"]
TEXT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]       # repetitive: n-gram drafts from the start
LATE = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=4, chunk_size=7)
# no chunk rides on the answer: the join is pending through it, and post-answer chunks join after it
AFTER = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=64, chunk_size=7)


class _EveryOther:
    """Replays an answer (speculation off's), silent on every other step: steps without drafts carry the
    turn's chunks, so verify steps and joins interleave; the answer drifts from the replayed one as the
    chunks' schedule does, so drafts are rejected too."""

    needs_hidden = False

    def __init__(self):
        self.answer: list[int] = []
        self.calls = 0

    def observe(self, session, next_tokens, positions, hidden):
        pass

    def propose(self, session, history, k):
        self.calls += 1
        if not self.calls % 2:
            return []
        for g in range(min(len(self.answer), len(history)), 0, -1):   # the answer's start the history ends with
            if list(history[-g:]) == self.answer[:g]:
                return self.answer[g:g + k]
        return []

    def rollback(self, session, length):
        pass

    def release(self, session):
        pass


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3.5 whose deferred rows' attention outputs later layers read, with slow decays (applied
    to each engine too, `slow_decays`): a join over wrong rows shows in the logits."""
    return two_attention_hybrid(tmp_path_factory)


def _prompt(engine: Engine, seed: int) -> Prompt:
    image = image_prompt(engine, seed=seed, grid=(1, 16, 24))
    return Prompt(image.token_ids + TEXT, image.visuals)


class _Schedule:
    """The rows of a run in processing order (tests/deferral/cross_turn.py `RowLog`), a verify segment's
    every row until `keep` drops the rejected ones."""

    def __init__(self, engine: Engine):
        self.engine, self.log, self.verify = engine, RowLog(), []
        self.plans: list[StepPlan] = []
        self.writer: dict[int, Kind] = {}       # each slot's last writer

    def __call__(self, plan: StepPlan) -> None:
        self.plans.append(plan)
        for seg in plan.segments:
            for slot in seg.write_slots.tolist():
                self.writer[slot] = seg.kind
            if seg.kind is Kind.DEFERRED:    # deferred rows never read a draft's or a rejected row's slot
                assert not any(self.writer.get(s) is Kind.VERIFY for s in seg.read_slots.tolist())
            if seg.kind is not Kind.VERIFY:
                self.log.record(self.engine, StepPlan([seg]))
                continue
            turn = self.engine.core.cache(seg.session).latest_turn
            self.verify.append((seg, len(self.log.rows)))
            self.log.rows += [Row(t, None, torch.full((3,), seg.position + i), [], turn, True, False, sample=True)
                              for i, t in enumerate(seg.tokens)]

    def keep(self, answer_end: int) -> int:
        """Drop each verify segment's rejected rows (a segment kept the rows up to where the next answer row
        starts; the last, up to the answer's last fed position `answer_end`); returns how many rows were."""
        answer = [s for p in self.plans for s in p.segments if s.kind in (Kind.DECODE, Kind.VERIFY)]
        ends = {id(a): b.position for a, b in itertools.pairwise(answer)}
        dropped = 0
        for seg, at in reversed(self.verify):
            kept = ends.get(id(seg), answer_end) - seg.position
            del self.log.rows[at + kept:at + seg.rows]
            dropped += seg.rows - kept
        return dropped


@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_tokens_see_exactly_the_rows_of_their_own_schedule(hybrid, backend):
    """Qwen3.5 under raincheck, verify steps while D's join is pending (tracked: their kept rows extend
    P_rest and complete the lead) between steps whose chunks join: every token's logits equal the exact
    reference over the rows as the run processed them (deferred rows on the prefix state, the live state
    re-applied from the recorded suffix of kept rows after each chunk), and no deferred row read a slot a
    verify segment wrote."""
    hf, folder = hybrid
    drafter = _EveryOther()
    engine = Engine.from_pretrained(folder, prefix_cache=False, speculative=SpeculativeConfig("ngram", 3),
                                    drafter=drafter, backend=backend)
    slow_decays(hf, engine)
    prompt = _prompt(engine, 71)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    engine.speculate(None)
    drafter.answer = engine.open_session(deferral=LATE).turn(prompt, params).result().token_ids
    engine.speculate(3)
    schedule = _Schedule(engine)
    remove = engine.on_plan(schedule)
    session = engine.open_session(deferral=LATE)
    stream = session.turn(prompt, params, return_logits=True)
    events = stream.tokens()
    metrics = stream.result().metrics
    session.close()
    remove()
    ids, logits = [e.token_id for e in events], torch.stack([e.logits for e in events])
    plans = schedule.plans
    pending_verify = [p for p in plans if any(s.kind is Kind.VERIFY and s.tracked for s in p.segments)]
    assert pending_verify and metrics.drafts_proposed > metrics.drafts_accepted > 0
    # chunks joined between verify steps, so later tokens see the join over kept rows
    first = plans.index(pending_verify[0])
    assert any(p.rows_of(Kind.DEFERRED) for p in plans[first:])
    for p in plans:      # never a tracked verify and a chunk of its own session in one step
        verifying = {s.session for s in p.segments if s.kind is Kind.VERIFY and s.tracked}
        assert not verifying & {s.session for s in p.segments if s.kind is Kind.DEFERRED}
    start = next(s.position for p in plans for s in p.segments if s.kind in (Kind.DECODE, Kind.VERIFY))
    assert schedule.keep(start + len(ids) - 1) > 0       # some drafts were rejected
    rows = schedule.log.rows
    ref = reference(hf, rows)
    sampled = [i for i, r in enumerate(rows) if r.sample]
    assert len(sampled) == len(ids)
    assert float((logits - ref.logits[sampled]).abs().max()) <= TOL


def _answer_and_join(hybrid, k: int | None, monkeypatch, backend: str) -> tuple[list[int], dict, int]:
    """A greedy answer with D's join pending throughout, the join when its recovery completes, and how
    many drafts were rejected."""
    hf, folder = hybrid
    engine = Engine.from_pretrained(folder, prefix_cache=False, speculative=SpeculativeConfig("ngram", 3),
                                    backend=backend)
    slow_decays(hf, engine)
    engine.speculate(k)
    engine.audit_gdn_join = True     # the join keeps every token's factors it folded into P_rest
    joins = on_join_release(monkeypatch, lambda j: {"p_rest": j.p_rest.clone(), "s_lead": j.s_lead.clone(),
                                                    "lead_u": j.lead_u.clone(), "fed": j.fed, "factors": j.factors,
                                                    "live": j.pool.ssm[j.live].clone()})
    tracked = []
    remove = engine.on_plan(lambda p: tracked.extend(s.rows for s in p.segments if s.kind is Kind.VERIFY and s.tracked))
    session = engine.open_session(deferral=AFTER)
    end = session.turn(_prompt(engine, 72), SamplingParams(max_new_tokens=20, ignore_eos=True)).result()
    session.complete_recovery()      # D's chunks join after the answer (P_rest folded at the first)
    session.close()
    remove()
    assert len(joins) == 1
    # every draft was verified while the join was pending: drafts rejected there were tracked rows
    assert sum(tracked) - len(tracked) == end.metrics.drafts_proposed
    return end.token_ids, joins[0], end.metrics.drafts_proposed - end.metrics.drafts_accepted


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejected_rows_never_enter_a_join(hybrid, monkeypatch, backend):
    """The join is pending through the whole answer; speculation on, verify steps that reject drafts are
    tracked: the factors folded into P_rest (kept for audit), P_rest, the lead's records, S_lead after D's
    chunks and the joined live state equal those of plain decoding of the same (greedy, identical) answer,
    where only the fed tokens extend the join. A rejected row in P_rest or the lead would change them."""
    ids, plain, _ = _answer_and_join(hybrid, None, monkeypatch, backend)
    ids_s, spec, rejected = _answer_and_join(hybrid, 3, monkeypatch, backend)
    assert ids_s == ids and rejected > 0
    assert spec["fed"] == plain["fed"] == len(ids) - 1
    for name in ("lead_u", "p_rest", "s_lead", "live"):     # rows of other shapes: projections round apart
        assert float((spec[name] - plain[name]).abs().max()) <= TOL, name
    # and the factors folded into P_rest themselves, token by token
    for layer, layer_plain in zip(spec["factors"], plain["factors"], strict=True):
        assert len(layer) == len(layer_plain) == len(ids) - 1 - 3      # the fed tokens past the lead
        for token, token_plain in zip(layer, layer_plain, strict=True):
            for f, f_plain in zip(token, token_plain, strict=True):
                assert float((f - f_plain).abs().max()) <= TOL
