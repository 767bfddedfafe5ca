"""The step's update reads values the forward computed only where it draws tokens (engine/update.py): the
slots filled, the GDN slot flips and the cursors come first, so that on a GPU, where the forward returns
before its kernels finish, that bookkeeping runs while they compute. Checked on the CPU by the order of
calls within each update: no fill or commit after the first read of the logits' values (plain decode steps
and steps with fused deferred chunks of a GDN model; a speculative step's verification reads first by
necessity and is not part of this)."""

from __future__ import annotations

import pytest

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.cache.gdn_state import GDNStatePool
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine import session_cache, step, update
from tests.engine.reference import image_tokens, random_visual


def record_calls(monkeypatch, calls: list[str]) -> None:
    """Append to `calls`, as they happen, each update ("update"), slot fill, GDN commit and read of the
    logits' values ("read")."""
    def recording(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    for owner, attr, name in ((step, "apply_step", "update"), (update, "row_maxima", "read"),
                              (session_cache.SessionCache, "fill", "fill"), (GDNStatePool, "commit", "commit")):
        monkeypatch.setattr(owner, attr, recording(name, getattr(owner, attr)))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
def test_bookkeeping_precedes_the_first_read_of_the_logits(tiny_checkpoints, family, monkeypatch):
    calls: list[str] = []
    record_calls(monkeypatch, calls)
    engine = Engine.from_pretrained(tiny_checkpoints[family][1])
    cfg = engine.model_config
    visual = random_visual("image", (1, 16, 16), cfg.hidden_size, cfg.deepstack_levels, seed=1)
    deferring, plain = engine.open_session(), engine.open_session()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    turns = [deferring.turn(Prompt([*range(10, 60), *image_tokens((1, 16, 16)), 7], [visual]), params,
                            deferral=DeferralConfig("raincheck", tpot_slo=None, guard=0, chunk_size=7)),
             plain.turn(Prompt(list(range(20, 70))), params)]
    for t in turns:
        t.tokens()
    steps = "".join("|" if c == "update" else c[0] for c in calls).split("|")[1:]
    decoding = [s for s in steps if "r" in s]
    assert len(decoding) >= 12
    for s in decoding:
        after = s[s.index("r"):]
        assert "f" not in after and "c" not in after, s
    if family == "qwen3_5":
        assert all("c" in s for s in decoding)


def test_the_read_hook_marks_where_the_update_first_reads_the_forward(tiny_checkpoints, monkeypatch, caplog):
    """`Engine.on_read`: once per update, after its fills and before its first read of the logits (what a
    benchmark times as running beside the forward on a device); a hook that raises is logged, and the step
    and its tokens go on as without it."""
    calls: list[str] = []
    record_calls(monkeypatch, calls)
    folder = tiny_checkpoints["qwen3_5"][1]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompt = Prompt(list(range(20, 70)))
    expected = [t.token_id for t in Engine.from_pretrained(folder).open_session().turn(prompt, params).tokens()]
    calls.clear()
    engine = Engine.from_pretrained(folder)
    plans = []
    engine.on_read(lambda plan: (calls.append("hook"), plans.append(plan)))

    def failing(_plan):
        raise RuntimeError("an observer's bug")
    remove = engine.on_read(failing)
    assert [t.token_id for t in engine.open_session().turn(prompt, params).tokens()] == expected
    steps = "".join("|" if c == "update" else c[0] for c in calls).split("|")[1:]
    assert len(steps) == len(plans) >= 6
    assert all(s == "fchr" for s in steps), steps        # fill, GDN commit, the hook, the first read
    assert "a read hook failed" in caplog.text
    remove()
