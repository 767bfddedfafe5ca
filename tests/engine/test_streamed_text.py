"""A turn's streamed text is found as its events are handed out (engine/request.py `text_of`), not in the
engine's step: a consumer that reads late gets the same deltas as one reading each token as it comes, and
they join to the answer's text. On the demo model, whose tokenizer the answers stream through."""

from __future__ import annotations

from raincheck_core import SamplingParams
from raincheck_core.engine.events import TokenEvent
from tests.demo.helpers import V2, engine, needs_v2


@needs_v2
def test_a_consumer_reading_late_gets_the_deltas_of_one_reading_as_it_comes():
    eng = engine(V2)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    question = "What shapes are in the picture, and which colour is the largest one?"
    live = eng.open_session()
    late = eng.open_session()
    try:
        as_it_comes = list(live.turn(question, params))
        stream = late.turn(question, params)
        while not stream.request.finished:      # the steps run the whole answer before anything is read
            eng.step()
        assert all(e.text == "" for e in stream.request.events if isinstance(e, TokenEvent))
        read_late = list(stream)
    finally:
        live.close()
        late.close()
    texts = [[e.text for e in events if isinstance(e, TokenEvent)] for events in (as_it_comes, read_late)]
    assert texts[0] == texts[1]
    assert "".join(texts[1]) == read_late[-1].text != ""
    assert [e.index for e in read_late if isinstance(e, TokenEvent)] == list(range(40))
