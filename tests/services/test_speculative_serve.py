"""Speculative decoding served (`--speculative-method ngram`): the SDK's turn metrics carry the drafts
verified and accepted, the worker's Prometheus counters add them up, the answers are those of an engine
without speculation, and the HTTP usage reports them as OpenAI reports predicted outputs."""

from __future__ import annotations

from raincheck_client._gen import chat_pb2
from raincheck_core import Engine, Message, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from services.common.metrics import ACCEPTED_TOKENS, DRAFT_TOKENS
from services.common.store import MemoryStore
from services.http.openai_api import usage_body
from services.http.session_matching import Done, Usage

TEXT = "ab ab ab ab ab ab ab"


def test_the_sdk_and_prometheus_see_the_drafts_and_the_answer_is_unchanged(cluster, checkpoint):
    store = MemoryStore()
    cluster.worker(store, speculative_method="ngram", speculative_tokens=3)
    client = cluster.client(cluster.frontend(store))
    drafts, accepted = DRAFT_TOKENS._value.get(), ACCEPTED_TOKENS._value.get()
    session = client.create_session(policy="full")
    turn = session.send(TEXT, max_new_tokens=24, ignore_eos=True)
    turn.text()
    answer = turn.final.token_ids
    m = turn.metrics
    assert m.drafts_proposed > 0 and 0 <= m.drafts_accepted <= m.drafts_proposed
    assert (DRAFT_TOKENS._value.get() - drafts, ACCEPTED_TOKENS._value.get() - accepted) == \
        (m.drafts_proposed, m.drafts_accepted)
    reference = Engine.from_pretrained(checkpoint).open_session(deferral=DeferralConfig("full"))
    plain = reference.turn(Message(TEXT), SamplingParams(max_new_tokens=24, ignore_eos=True)).result()
    assert answer == plain.token_ids
    session.close()


def test_http_usage_reports_accepted_and_rejected_predictions():
    def done(proposed: int, accepted: int, choice: int) -> Done:
        metrics = chat_pb2.TurnMetrics(drafts_proposed=proposed, drafts_accepted=accepted)
        return Done("", "length", None, Usage(10, 8, 0), "s", "new", metrics, choice=choice)

    usage = usage_body([done(6, 4, 0), done(3, 1, 1)])
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 5, "rejected_prediction_tokens": 4}
    assert done(6, 4, 0).details()["drafts_accepted"] == 4
