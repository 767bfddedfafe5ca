"""Speculative decoding on the hybrid family (Qwen3.5) while a GDN join is pending (docs/mechanism.md §13):
a verify segment is tracked, and only its kept rows extend the join. Every token's logits equal an exact
reference over the rows of the speculative run's own schedule (verify steps while the join is pending,
rejected drafts included); a join's P_rest, lead and S_lead after verify steps that rejected drafts equal
those of plain decoding; deferred rows never read a draft or rejected slot (checked as the steps are
planned); a verify segment and a chunk of its own session never share a step; a bounded follow-up verifies
beside two pending joins, the younger one's lead recorded from inside its verify rows. With rejected rows
fed to the joins all three fail (the identities by 2e-2 on this model's slow decays)."""

from __future__ import annotations

import itertools

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams, Session
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine import scheduler
from raincheck_core.engine.plan import Kind, StepPlan
from raincheck_core.speculative.config import SpeculativeConfig
from tests.deferral.cross_turn import Row, RowLog, reference
from tests.deferral.helpers import image_prompt, on_join_release, rel_err, slow_decays, two_attention_hybrid
from tests.engine.reference import image_tokens, random_visual

TOL = 1e-5
# the native kernel copies a verify segment's states out as it passes; the chunked rules replay them (§5.8)
BACKENDS = ["native", "torch"]
TEXT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]       # repetitive: n-gram drafts from the start
LATE = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=4, chunk_size=7)
# no chunk rides on the answer: the join is pending through it, and post-answer chunks join after it
AFTER = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=64, chunk_size=7)


class _EveryOther:
    """Replays answers (speculation off's), silent on every other step: steps without drafts carry the
    turn's chunks, so verify steps and joins interleave; the answer drifts from the replayed one as the
    chunks' schedule does, so drafts are rejected too."""

    needs_hidden = False

    def __init__(self, every: int = 2):
        self.answers: list[list[int]] = []
        self.calls, self.every = 0, every       # drafts on one call of `every`

    def observe(self, session, next_tokens, positions, hidden):
        pass

    def propose(self, session, history, k):
        self.calls += 1
        if self.calls % self.every:
            return []
        # the longest start of an answer the history ends with
        starts = [(g, a) for a in self.answers for g in range(min(len(a), len(history)), 0, -1)
                  if list(history[-g:]) == a[:g]]
        g, answer = max(starts, key=lambda s: s[0], default=(0, []))
        return answer[g:g + k]

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
        self.answering: dict[int, list] = {}      # turn -> its decode and verify segments, in order
        self.plans: list[StepPlan] = []
        self.writer: dict[int, int | None] = {}     # slot -> the turn of its last writer if a verify segment
        self.joins_in_lead: list[list[bool]] = []   # per verify segment: which pending joins lack lead tokens

    def __call__(self, plan: StepPlan) -> None:
        self.plans.append(plan)
        for seg in plan.segments:
            cache = self.engine.core.cache(seg.session)
            turn = cache.latest_turn
            for slot in seg.write_slots.tolist():
                self.writer[slot] = turn if seg.kind is Kind.VERIFY else None
            if seg.kind is Kind.DEFERRED:
                # deferred rows never read a draft's or a rejected row's slot of their turn or a later one
                # (an earlier turn's kept answer rows they do read: docs/mechanism.md §10.1)
                verified = [self.writer.get(s) for s in seg.read_slots.tolist()]
                assert not any(t is not None and t >= cache.recovery.turn for t in verified)
            if seg.kind in (Kind.DECODE, Kind.VERIFY):
                self.answering.setdefault(turn, []).append(seg)
            if seg.kind is not Kind.VERIFY:
                self.log.record(self.engine, StepPlan([seg]))
                continue
            self.verify.append((seg, len(self.log.rows)))
            joins = [r.join for r in self.engine.core.cache(seg.session).recoveries()
                     if r.join is not None and not r.done]
            self.joins_in_lead.append([j.fed < j.lead for j in joins])
            self.log.rows += [Row(t, None, torch.full((3,), seg.position + i), [], turn, True, False, sample=True)
                              for i, t in enumerate(seg.tokens)]

    def keep(self, answers: list[list[int]]) -> int:
        """Drop each verify segment's rejected rows, given each turn's answer: a segment kept the rows up to
        where its turn's next answer row starts, the last up to the answer's last fed token; returns how many
        rows were dropped."""
        ends = {}
        for turn, segs in self.answering.items():
            ends |= {id(a): b.position for a, b in itertools.pairwise(segs)}
            ends[id(segs[-1])] = segs[0].position + len(answers[turn]) - 1
        dropped = 0
        for seg, at in reversed(self.verify):
            kept = ends[id(seg)] - seg.position
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
    drafter.answers = [engine.open_session(deferral=LATE).turn(prompt, params).result().token_ids]
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
    assert schedule.keep([ids]) > 0       # some drafts were rejected
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


FIRST = DeferralConfig("post_answer", selector="uniform", chunk_size=7)       # all of D left after the answer
FOLLOW = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7, barrier_timeout_s=0)


def _dialogue(engine: Engine, follow_up: Prompt) -> tuple[list[list[int]], list[torch.Tensor], Session]:
    """A turn that leaves its D pending, then a follow-up with its own image admitted past a bounded
    barrier (tests/deferral/test_bounded_barrier.py); everything restored after. Each turn's answer and
    logits, and the session."""
    session = engine.open_session(deferral=FIRST)
    ids, logits = [], []
    for prompt, n, cfg in ((image_prompt(engine, seed=30), 6, None), (follow_up, 12, FOLLOW)):
        stream = session.turn(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), deferral=cfg,
                              return_logits=True)
        events = stream.tokens()
        ids.append([e.token_id for e in events])
        logits.append(torch.stack([e.logits for e in events]))
    session.complete_recovery()
    return ids, logits, session


def test_a_follow_up_verifies_beside_two_pending_joins(hybrid, monkeypatch):
    """A bounded follow-up with its own deferred rows decodes while the previous turn's late rows and its
    own D are pending: tracked verify steps extend both joins (the younger one's lead while the older's is
    complete), and every token of both turns and the live state after both are restored equal the exact
    cross-turn reference over the run's own schedule (docs/mechanism.md §10.3, §13). Drafts at every step,
    and they win over chunks wherever offered (the choice is test_scheduler.py's): the late rows wait
    for steps without drafts or the gap after the answer."""
    hf, folder = hybrid
    monkeypatch.setattr(scheduler, "drafts_win", lambda *_: True)
    drafter = _EveryOther(every=1)
    engine = Engine.from_pretrained(folder, prefix_cache=False, speculative=SpeculativeConfig("ngram", 3),
                                    drafter=drafter)
    slow_decays(hf, engine)
    engine.core.scheduler.recovery_chunk = 5        # 5 rows ahead of the follow-up's input, 11 late
    mc = engine.model_config
    visual = random_visual("image", (1, 8, 8), mc.hidden_size, mc.deepstack_levels, seed=31)
    follow_up = Prompt([11, 12, *image_tokens((1, 8, 8)), 13], [visual])
    engine.speculate(None)
    drafter.answers, _, plain = _dialogue(engine, follow_up)
    plain.close()
    engine.speculate(3)
    schedule = _Schedule(engine)
    remove = engine.on_plan(schedule)
    ids, logits, session = _dialogue(engine, follow_up)
    remove()
    # some verify step ran beside both joins, the younger one's lead incomplete, the older one's complete
    assert [False, True] in schedule.joins_in_lead
    schedule.keep(ids)
    ref = reference(hf, schedule.log.rows)
    for turn in (0, 1):
        assert float((logits[turn] - ref.logits[schedule.log.sampled(turn)]).abs().max()) <= TOL, turn
    for g, layer in enumerate(sorted(ref.live)):
        assert rel_err(engine.gdn.ssm[session.cache.gdn_slot][g], ref.live[layer]) <= TOL, layer
    session.close()
