"""SGLang's own frontend language against Raincheck, where the sglang package is installed (skipped
otherwise: with its imports it is about 1.3 GB, too much for CI; test_sglang.py checks the same
protocol from the requests RuntimeEndpoint sends). docs/services.md shows how to run it by hand."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from .helpers import KEYS, dialogue

sgl = pytest.importorskip("sglang")


@sgl.function
def image_chat(s, image_path, questions):
    s += sgl.user(sgl.image(image_path) + questions[0])
    s += sgl.assistant(sgl.gen("answer_0", max_tokens=48, temperature=0))
    for i, question in enumerate(questions[1:], 1):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=48, temperature=0))


@pytest.mark.parametrize("stream", [False, True])
def test_sgl_function_runs_across_turns_on_one_session(stack, tmp_path, stream):
    d = dialogue(seed=16)
    path = tmp_path / "scene.png"
    path.write_bytes(d.scene.png())
    backend = sgl.RuntimeEndpoint(stack.http.url, api_key=KEYS[0])     # /get_model_info picks qwen2-vl
    assert backend.chat_template.name == "qwen2-vl"
    continued = REGISTRY.get_sample_value("raincheck:http_session_matches_total", {"result": "continued"}) or 0
    state = image_chat.run(image_path=str(path), questions=[q.text for q in d.questions], backend=backend,
                           stream=stream)
    if stream:
        for _ in state.text_iter():
            pass
    answers = [state[f"answer_{i}"] for i in range(len(d.questions))]
    assert all(answers)
    # turns 2 and 3 continued the first turn's session
    assert REGISTRY.get_sample_value("raincheck:http_session_matches_total", {"result": "continued"}) == continued + 2
    if not stream:   # SGLang keeps meta_info of non-streamed generations
        metas = [state.get_meta_info(f"answer_{i}") for i in range(len(d.questions))]
        assert [m["raincheck"]["match"] for m in metas] == ["new", "continued", "continued"]
        assert all(m["cached_tokens"] > 0 for m in metas[1:])
