"""Speculative decoding (docs/mechanism.md §13): a verify segment of the last token and k drafts in the
ordinary step. Greedy answers are token-identical to speculation off, and kept rows' logits within 1e-5
of it (fp32), on both families and the demo model, under full and hard, for k = 1, 2, 3; under raincheck
(deferred chunks fused beside verify rows, Qwen3-VL) every token's logits equal a forward over exactly
the rows it could see, and no deferred row ever reads a draft or rejected row's slot; a failed verify
step leaves the session usable; sampled verification keeps the target distribution (chi-square at
temperature 1). The hybrid family's verify steps while a GDN join is pending:
tests/engine/test_speculative_hybrid.py."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.plan import Kind
from raincheck_core.errors import CheckpointError, InvalidInputError, StepFailedError, UnsupportedModelError
from raincheck_core.sampling import Sampler
from raincheck_core.speculative.config import SpeculativeConfig
from raincheck_core.speculative.ngram import NgramDrafter, lookup
from tests.deferral.helpers import concat, image_prompt, split, token_rows
from tests.demo.helpers import V2, needs_v2

FAMILIES = ["qwen3_vl", "qwen3_5"]
TOL = 1e-5
TEXT = Prompt([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7])       # a repetitive prompt: n-gram drafts from the start
FOLLOW_UP = Prompt([5, 6, 7, 8])
HARD = DeferralConfig("hard", selector="uniform")
RAINCHECK = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=0, chunk_size=7)
# chunks once four tokens are fed, when the random model's answer has begun to repeat (and drafts to hit)
LATE = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=4, chunk_size=7)


def _engine(folder, k: int = 3, method: str = "ngram", **options) -> Engine:
    # no prefix cache: both runs prefill the same rows in the same steps
    return Engine.from_pretrained(folder, prefix_cache=False, speculative=SpeculativeConfig(method, k), **options)


def _turns(engine: Engine, prompts: list[Prompt], cfg: DeferralConfig | None = None, n: int = 16):
    """Greedy turns of one session: generated ids, logits, metrics of each."""
    session = engine.open_session(deferral=cfg)
    out = []
    for prompt in prompts:
        stream = session.turn(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), return_logits=True)
        events = stream.tokens()
        out.append(([e.token_id for e in events], torch.stack([e.logits for e in events]), stream.result().metrics))
    session.close()
    return out




@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    return {f: (hf, _engine(folder)) for f, (hf, folder) in tiny_checkpoints.items() if f in FAMILIES}


def _same_answers(engine: Engine, prompts: list[Prompt], cfg: DeferralConfig | None, k: int) -> tuple[int, int]:
    engine.speculate(None)
    plain = _turns(engine, prompts, cfg)
    engine.speculate(k)
    spec = _turns(engine, prompts, cfg)
    for (ids, logits, _), (ids_s, logits_s, _) in zip(plain, spec, strict=True):
        assert ids_s == ids
        assert float((logits_s - logits).abs().max()) <= TOL
    return sum(m.drafts_proposed for *_, m in spec), sum(m.drafts_accepted for *_, m in spec)


def test_ngram_proposes_what_followed_the_longest_latest_match():
    assert lookup(np.array([1, 2, 3, 4, 9, 1, 2, 3]), 3, 1, 4) == [4, 9, 1]
    assert lookup(np.array([8, 5, 6, 5, 6]), 5, 1, 4) == [5, 6, 5, 6, 5]        # a loop goes on looping
    assert lookup(np.array([7, 1, 8, 2, 1, 9, 2, 1]), 2, 1, 4) == [9, 2]      # "2 1" beats the later "1"
    assert lookup(np.array([1, 2, 3]), 3, 1, 4) == []
    assert lookup(np.array([4, 5, 4]), 3, 2, 4) == []                          # only a 1-gram occurs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["full", "hard"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_is_token_identical_to_speculation_off(engines, family, policy, k):
    _, engine = engines[family]
    first = TEXT if policy == "full" else Prompt(image_prompt(engine, seed=60).token_ids + TEXT.token_ids,
                                                 image_prompt(engine, seed=60).visuals)
    proposed, accepted = _same_answers(engine, [first, FOLLOW_UP], HARD if policy == "hard" else None, k)
    assert proposed > 0 and accepted > 0


@pytest.mark.parametrize("backend", ["native", "torch", "flex"])
def test_rejected_drafts_cut_the_gdn_state_at_the_last_kept_row(tiny_checkpoints, backend):
    """On the hybrid family some drafts are rejected (the state after a row inside the verify segment is
    the one kept: copied out by the native kernel, replayed by the chunked rules), and the answers still
    match: the state cut is exact."""
    engine = _engine(tiny_checkpoints["qwen3_5"][1], backend=backend)
    proposed, accepted = _same_answers(engine, [Prompt([20, 21, 22, 20, 21, 22, 20, 21])], None, 3)
    assert 0 < accepted < proposed


def test_bad_settings_and_a_checkpoint_without_an_mtp_head_are_typed_errors(tiny_checkpoints):
    with pytest.raises(InvalidInputError, match="speculative method"):
        SpeculativeConfig("eagle")
    with pytest.raises(InvalidInputError, match="num_tokens"):
        SpeculativeConfig("ngram", 0)
    # Qwen3-VL ships no MTP head: loading one for it fails before anything runs
    with pytest.raises((UnsupportedModelError, CheckpointError)):
        Engine.from_pretrained(tiny_checkpoints["qwen3_vl"][1], speculative=SpeculativeConfig("mtp"))


@pytest.mark.parametrize("end", ["stop", "length"])
def test_an_answer_never_runs_past_its_stop_token_or_length(engines, end):
    """A stop token or the length limit inside a verify segment's accepted drafts ends the answer there,
    as plain decoding ends it."""
    _, engine = engines["qwen3_vl"]
    engine.speculate(None)
    ids = _turns(engine, [TEXT], n=20)[0][0]
    stop = next(t for i, t in enumerate(ids) if i >= 6 and t not in ids[:i])     # first seen late
    params = SamplingParams(max_new_tokens=20, stop_token_ids=[stop]) if end == "stop" else \
        SamplingParams(max_new_tokens=ids.index(stop) + 1, ignore_eos=True)
    results = []
    for k in (None, 3):
        engine.speculate(k)
        results.append(engine.open_session().turn(TEXT, params).result())
    assert results[1].token_ids == results[0].token_ids == ids[:ids.index(stop) + 1]
    assert results[1].finish_reason == results[0].finish_reason == end
    assert results[1].metrics.drafts_proposed > 0


class _Recording:
    """An n-gram drafter that also records what it is told, and asks for hidden states (as an MTP head)."""

    needs_hidden = True

    def __init__(self):
        self.inner = NgramDrafter(SpeculativeConfig("ngram"))
        self.rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.rollbacks: list[int] = []

    def observe(self, session, next_tokens, positions, hidden):
        self.rows.append((next_tokens, positions, hidden))

    def propose(self, session, history, k):
        return self.inner.propose(session, history, k)

    def rollback(self, session, length):
        self.rollbacks.append(length)

    def release(self, session):
        pass


def test_a_drafter_observes_every_kept_row_with_its_final_norm_hidden_state(tiny_checkpoints):
    """What `Drafter.observe` gets: each input and kept answer row once, in order, the token after it and
    the target's last-layer hidden state after the final norm (transformers' `last_hidden_state`); the
    rows a verify rejected are rolled back."""
    hf, folder = tiny_checkpoints["qwen3_vl"]
    drafter = _Recording()
    engine = Engine.from_pretrained(folder, prefix_cache=False, speculative=SpeculativeConfig("ngram", 3),
                                    drafter=drafter)
    end = engine.open_session().turn(TEXT, SamplingParams(max_new_tokens=16, ignore_eos=True)).result()
    stream = [*TEXT.token_ids, *end.token_ids]
    after = torch.cat([t for t, _, _ in drafter.rows])
    positions = torch.cat([p for _, p, _ in drafter.rows], dim=1)
    hidden = torch.cat([h for _, _, h in drafter.rows])
    assert after.tolist() == stream[1:]
    assert positions[0].tolist() == list(range(len(stream) - 1))
    with torch.no_grad():
        ref = hf.model.language_model(input_ids=torch.tensor([stream[:-1]])).last_hidden_state[0]
    assert float((hidden - ref).abs().max()) <= 1e-4
    assert end.metrics.drafts_accepted < end.metrics.drafts_proposed and drafter.rollbacks


@needs_v2
@pytest.mark.parametrize("method", ["ngram", "mtp"])       # demo-v2 ships a trained MTP head
@pytest.mark.parametrize("kind", ["single", "multi", "video"])
def test_demo_dialogues_are_token_identical(kind, method):
    from raincheck_demo.world import make_dialogue, make_multi_dialogue, make_video_dialogue

    rng = random.Random(4242)
    d = {"single": lambda: make_dialogue(rng, turns=3),
         "multi": lambda: make_multi_dialogue(rng, images=2, turns=3),
         "video": lambda: make_video_dialogue(rng, frames=3, turns=3)}[kind]()
    engine = _engine(V2, method=method, num_threads=1)
    proposed = accepted = 0
    for policy in ("full", "hard"):
        answers = {}
        for k in (None, 1, 2, 3):
            engine.speculate(k)
            session = engine.open_session(deferral=DeferralConfig(policy, selector="uniform"))
            out = []
            for t in range(len(d.questions)):
                stream = session.turn(d.message(t), SamplingParams(max_new_tokens=24), return_logits=True)
                events = list(stream.tokens())
                out.append(([e.token_id for e in events], torch.stack([e.logits for e in events])))
                proposed += stream.end.metrics.drafts_proposed
                accepted += stream.end.metrics.drafts_accepted
            session.close()
            answers[k] = out
        for k in (1, 2, 3):
            for (ids, logits), (ids_s, logits_s) in zip(answers[None], answers[k], strict=True):
                assert ids_s == ids
                # the trained model's logits reach ~10: a verify segment's k + 1 rows and a decode row's one
                # take different GEMM blockings, so the bound is relative to their size (1.05e-5 absolute
                # seen on an AVX2-only host)
                assert float((logits_s - logits).abs().max()) <= TOL * max(1.0, float(logits.abs().max()))
    if method == "mtp":     # the trained head drafts at every step and is often right (n-gram rarely finds a match)
        assert proposed > 0 and accepted > 0


def _plans(engine: Engine) -> tuple[list, object]:
    plans = []
    return plans, engine.on_plan(plans.append)


def _masked_forward(hf, pieces, deferred: torch.Tensor, input_rows: int) -> torch.Tensor:
    """transformers' decoder over `pieces` in the engine's processing order, each row seeing what
    docs/mechanism.md §4 lets it see: deferred rows (`deferred`) the input and earlier deferred rows, answer
    rows everything before them; logits `[T, vocab]`."""
    embeds, positions, ds_rows, ds_feats = concat(*pieces)
    rows = embeds.shape[0]
    answer = ~deferred
    answer[:input_rows] = False
    allowed = torch.ones(rows, rows, dtype=torch.bool).tril() & ~(deferred[:, None] & answer[None, :])
    kwargs = {}
    if ds_feats:
        visual = torch.zeros(rows, dtype=torch.bool)
        visual[ds_rows] = True
        order = torch.argsort(ds_rows)       # transformers takes features in row order
        kwargs = dict(visual_pos_masks=visual[None], deepstack_visual_embeds=[f[order] for f in ds_feats])
    mask = torch.zeros(1, 1, rows, rows).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        out = hf.model.language_model(inputs_embeds=embeds[None], position_ids=positions[:, None],
                                      attention_mask=mask, **kwargs)
        return hf.lm_head(out.last_hidden_state)[0].float()


def test_raincheck_tokens_see_exactly_the_rows_of_their_own_schedule(engines):
    """Qwen3-VL under raincheck, chunks fused beside verify segments: every token's logits equal a forward
    over the rows as the speculative run's own schedule processed them (I0; then per step its deferred rows
    and the answer rows it kept), each row seeing what §4 lets it see."""
    hf, engine = engines["qwen3_vl"]
    engine.speculate(3)
    prompt = Prompt(image_prompt(engine, seed=61).token_ids + TEXT.token_ids, image_prompt(engine, seed=61).visuals)
    plans, remove = _plans(engine)
    ((ids, logits, metrics),) = _turns(engine, [prompt], LATE, n=14)
    remove()
    assert metrics.drafts_accepted > 0
    assert any(p.count(Kind.VERIFY) and p.rows_of(Kind.DEFERRED) for p in plans)     # fused beside each other
    i0, d = split(engine, prompt, LATE)
    start = i0.next_position
    answer = [s for p in plans for s in p.segments if s.kind in (Kind.DECODE, Kind.VERIFY)]
    # a segment kept the rows up to where the next one starts (the last: up to the answer's last token)
    ends = [s.position for s in answer[1:]] + [start + len(ids) - 1]
    pieces, deferred, row_of, at = [i0], [False] * len(i0), {}, len(i0)
    for seg in (s for p in plans for s in p.segments):
        if seg.kind is Kind.DEFERRED:
            pieces.append(d.subset(torch.arange(seg.first, seg.first + seg.rows)))
            deferred += [True] * seg.rows
            at += seg.rows
        elif seg.kind in (Kind.DECODE, Kind.VERIFY):
            first, kept = seg.position - start, ends[answer.index(seg)] - seg.position
            row_of.update({first + r: at + r for r in range(kept)})
            pieces.append(token_rows(engine, ids[first:first + kept], seg.position))
            deferred += [False] * kept
            at += kept
    ref = _masked_forward(hf, pieces, torch.tensor(deferred), len(i0))
    assert float((logits[0] - ref[len(i0) - 1]).abs().max()) <= TOL
    for j in range(1, len(ids)):      # token j was drawn at the row holding token j - 1
        assert float((logits[j] - ref[row_of[j - 1]]).abs().max()) <= TOL


def test_deferred_rows_never_read_a_draft_or_rejected_slot(engines):
    """Every slot a verify segment wrote holds a generated or rejected row until another segment writes it
    again: no deferred row may read it (the check fails if the scheduler hands one a draft's slot)."""
    _, engine = engines["qwen3_vl"]
    engine.speculate(3)
    writer: dict[int, Kind] = {}
    checked = [0]

    def check(plan):
        for seg in plan.segments:
            for slot in seg.write_slots.tolist():
                writer[slot] = seg.kind
            if seg.kind is Kind.DEFERRED:
                assert not any(writer.get(s) is Kind.VERIFY for s in seg.read_slots.tolist())
                checked[0] += 1

    remove = engine.on_plan(check)
    prompt = Prompt(image_prompt(engine, seed=62).token_ids + TEXT.token_ids, image_prompt(engine, seed=62).visuals)
    ((_, _, metrics),) = _turns(engine, [prompt], LATE, n=14)
    remove()
    assert checked[0] and metrics.drafts_proposed > metrics.drafts_accepted > 0


def test_a_failed_verify_step_leaves_the_session_usable(tiny_checkpoints):
    engine = _engine(tiny_checkpoints["qwen3_5"][1])

    def fail(plan):
        if plan.count(Kind.VERIFY):
            raise RuntimeError("injected verify failure")

    session = engine.open_session()
    remove = engine.on_plan(fail)
    with pytest.raises(StepFailedError, match="injected verify failure"):
        session.turn(TEXT, SamplingParams(max_new_tokens=20, ignore_eos=True)).result()
    remove()
    assert session.cached_tokens == 0 and session.turns == 0
    again = session.turn(TEXT, SamplingParams(max_new_tokens=20, ignore_eos=True), return_logits=True).tokens()
    fresh = engine.open_session().turn(TEXT, SamplingParams(max_new_tokens=20, ignore_eos=True),
                                       return_logits=True).tokens()
    assert [e.token_id for e in again] == [e.token_id for e in fresh]
    assert float((torch.stack([e.logits for e in again]) - torch.stack([e.logits for e in fresh])).abs().max()) <= TOL


def _chi_square(counts: Counter, probs: dict[int, float], n: int) -> float:
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items() if p > 0)


# the chi-square critical value at p = 0.001 by degrees of freedom (a true distribution fails 1 in 1000)
CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def test_rejection_sampling_keeps_a_small_vocabulary_distribution():
    """The sampler's draw against a draft, on a 5-token vocabulary: whatever the draft, the draws follow
    softmax(logits) (chi-square, 20,000 draws)."""
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    probs = dict(enumerate(torch.softmax(logits, -1).tolist()))
    for draft in (3, 2):        # the likeliest token, an unlikely one
        sampler = Sampler(SamplingParams(temperature=1.0, seed=7))
        counts = Counter(sampler(logits, draft) for _ in range(20000))
        assert _chi_square(counts, probs, 20000) < CRITICAL[4]


class _SecondLikeliest:
    """Drafts, after the prompt and one token, the token a forward says is the second likeliest next (so
    drafts are accepted often and rejected often)."""

    needs_hidden = False

    def __init__(self, second: dict[int, int], prompt: int):
        self.second, self.prompt = second, prompt

    def observe(self, session, next_tokens, positions, hidden):
        pass

    def propose(self, session, history, k):
        return [self.second[history[-1]]] if len(history) == self.prompt + 1 and history[-1] in self.second else []

    def rollback(self, session, length):
        pass

    def release(self, session):
        pass


def test_sampled_answers_keep_the_target_distribution(tiny_checkpoints):
    """Temperature 1 on the tiny Qwen3-VL, top_k 4 (a four-token vocabulary at each draw), 800 answers of
    one prompt (n > 1: they decode side by side): the second token, drawn from a verify row against a
    draft, follows the target's own distribution after the commonest first token (chi-square)."""
    folder = tiny_checkpoints["qwen3_vl"][1]
    plain = Engine.from_pretrained(folder, prefix_cache=False)
    top4 = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=4, ignore_eos=True, seed=11)
    prompt = TEXT.token_ids
    first = plain.forward_logits(torch.tensor(prompt))[-1]
    second, target = {}, {}
    for t in torch.topk(first, 4).indices.tolist():
        after = plain.forward_logits(torch.tensor([*prompt, t]))[-1]
        top = torch.topk(after, 4)
        second[t] = int(top.indices[1])
        target[t] = dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist(), strict=True))
    engine = _engine(folder, k=1, drafter=_SecondLikeliest(second, len(prompt)))
    ends = []
    for seed in range(8):
        params = dataclasses.replace(top4, n=100, seed=seed * 1000)
        ends += engine.open_session().turn(Prompt(prompt), params).results()
    assert sum(e.metrics.drafts_proposed for e in ends) > 0
    t1 = Counter(e.token_ids[0] for e in ends).most_common(1)[0][0]
    group = [e for e in ends if e.token_ids[0] == t1]
    counts = Counter(e.token_ids[1] for e in group)
    accepted = sum(e.metrics.drafts_accepted for e in group)
    assert 0 < accepted < len(group)
    assert _chi_square(counts, target[t1], len(group)) < CRITICAL[3]
    assert math.isclose(sum(target[t1].values()), 1.0, rel_tol=1e-5)
