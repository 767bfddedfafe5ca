"""The field's clients against a started `raincheck serve`: the openai client, litellm, langchain-openai,
instructor, SGLang's frontend language and lm-eval-harness, each as its users call it.

    make test-clients                                   # the venv (.venv-clients), a server, this script
    python tests/clients/conformance.py --server-python .venv/bin/python [--markdown [PATH]]
    python tests/clients/conformance.py --url http://127.0.0.1:8000 --image scene.png

It runs in the clients' own venv (requirements/clients.txt), apart from the server's: these packages pin
versions of openai, pydantic and httpx that the server's venv must not be held to. Not a pytest module (the
main suite has none of these packages); `make test-clients` runs it. With `--server-python` it starts
`raincheck serve` on the demo model on free loopback ports and renders a scene of the demo's world with that
interpreter; with `--url` it uses a server already running.

Every check: no request gets a 5xx (the server's own request counter, read from /metrics around each check,
so the openai client's silent retries of a 500 count too); a refusal is a 4xx whose message names the field.
The demo model's vocabulary cannot write JSON and its chat template renders no tools, so there structured
outputs and tools are refusals up front. Then (with --server-python) a second server on a tiny random
checkpoint whose vocabulary writes JSON and whose template renders tools and images, where each client's
structured output and tool call must come back parsed. Prints a table (client, version, check, result),
writes it as Markdown with --markdown (by default into this venv, as conformance.markdown), and exits 1 on any
failure.
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))      # bench.local_server (standard library only): this venv lacks the project
from bench.local_server import local_server  # noqa: E402

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
MODEL = "demo"
QUESTIONS = ("list the objects in row two .", "what colour is the object in row nine column four ?",
             "how many objects are in row one ?")
# offline: no model cost map, no hub look-ups (lm-eval's datasets and tokenizer are local files)
os.environ.update(LITELLM_LOCAL_MODEL_COST_MAP="True", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                  TOKENIZERS_PARALLELISM="false")


class Person(BaseModel):        # bounded: a random model's strings could otherwise run to max_tokens
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["paris", "rome"]}}}}}
TOOL_MODEL = "tiny-tools"


@dataclass
class Result:
    client: str
    version: str
    check: str
    ok: bool
    detail: str


class Failed(Exception):
    """A check's expectation did not hold."""


def expect(condition: object, message: str) -> None:
    if not condition:
        raise Failed(message)


def refusal(error: BaseException) -> tuple[int, str, str | None] | None:
    """(HTTP status, message, param) of the first HTTP error in `error`'s chain, as the openai client (and so
    langchain, instructor) and litellm carry it."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        status = getattr(e, "status_code", None)
        if isinstance(status, int):
            body = getattr(e, "body", None)
            if isinstance(body, dict) and "message" in body:
                return status, body["message"], body.get("param")
            return status, str(getattr(e, "message", None) or e), None
        e = e.__cause__ or e.__context__ or getattr(e, "last_exception", None)
    return None


def refused(call: Callable[[], object], field: str) -> str:
    """`call` is refused with a 4xx whose message names `field`."""
    try:
        call()
    except Exception as e:
        found = refusal(e)
        if found is None:
            raise Failed(f"{type(e).__name__} without an HTTP status: {e}") from e
        status, message, param = found
        expect(400 <= status < 500, f"{status}: {message}")
        expect(field in message, f"{status} not naming {field}: {message} (param {param})")
        return f"{status}: {message[:90]}"
    raise Failed(f"not refused (expected a 4xx naming {field})")


class Server:
    """The server under test: its URL, and its count of HTTP responses with a 5xx so far."""

    def __init__(self, url: str):
        self.url = url
        self.v1 = url + "/v1"

    def server_errors(self) -> int:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        return sum(int(float(m.group(1))) for m in
                   re.finditer(r'^raincheck:requests_total\{code="5\d\d",[^}]*service="http"\} (\S+)$', text, re.M))


def scene(python: str, path: Path) -> None:
    """A scene of the demo model's world, rendered by the server's interpreter (raincheck_demo)."""
    subprocess.run([python, "-c", "import random, sys; from raincheck_demo.world import random_scene; "
                    "open(sys.argv[1], 'wb').write(random_scene(random.Random(0)).png())", str(path)],
                   cwd=ROOT, check=True)


def tool_model(python: str, folder: Path) -> None:
    """A tiny random checkpoint whose vocabulary writes every printable ASCII character, its chat template
    rendering tools and images in Qwen3-VL's shape (tests/http/data/qwen_vl_tool_format.jinja): its answers are
    noise, which the grammar mask holds to a schema or a call, so the clients' structured outputs and tools get
    answers to parse."""
    template = ROOT / "tests" / "http" / "data" / "qwen_vl_tool_format.jinja"
    subprocess.run([python, "-c", "import sys; from pathlib import Path; from transformers import AutoTokenizer; "
                    "from services.common.random_model import save_random_model; "
                    "folder = save_random_model(sys.argv[1], 'tiny'); t = AutoTokenizer.from_pretrained(str(folder)); "
                    "t.chat_template = Path(sys.argv[2]).read_text(); t.save_pretrained(folder)",
                    str(folder), str(template)], cwd=ROOT, check=True)


def version(distribution: str) -> str:
    return importlib.metadata.version(distribution)


class Checks:
    """Every client's checks against one server; `run` records each as a Result."""

    def __init__(self, server: Server, image: Path):
        self.server = server
        self.image_url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
        self.image_path = image
        self.results: list[Result] = []

    def run(self, client: str, distribution: str, check: str, fn: Callable[[], str]) -> None:
        before = self.server.server_errors()
        started_at = time.monotonic()
        try:
            detail, ok = fn(), True
        except Exception as e:
            detail, ok = f"{type(e).__name__}: {e}"[:300], False
        errors = self.server.server_errors() - before
        if errors:
            detail, ok = f"{errors} response(s) with a 5xx; {detail}", False
        result = Result(client, version(distribution), check, ok, f"{detail} ({time.monotonic() - started_at:.1f} s)")
        self.results.append(result)
        print(f"{'ok  ' if ok else 'FAIL'} {client:10} {check:34} {result.detail}", flush=True)

    def user(self, text: str, image: bool = False) -> dict:
        if not image:
            return {"role": "user", "content": text}
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": self.image_url}},
                                            {"type": "text", "text": text}]}

    # -- the openai client ----------------------------------------------------------------------------
    def openai(self) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.server.v1, api_key="none")

        def image_chat() -> str:
            messages, cached = [self.user(QUESTIONS[0], image=True)], []
            for question in (None, *QUESTIONS[1:]):
                if question:
                    messages.append(self.user(question))
                r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
                expect(r.choices[0].message.content, "an empty answer")
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
            expect(all(cached[1:]), f"turns 2-3 continue the session: cached tokens {cached}")
            return f"3 turns, cached tokens {cached}"

        def streaming() -> str:
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=[self.user(QUESTIONS[0], image=True)], max_tokens=32, stream=True,
                stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            expect(text and chunks[-1].usage, "no text or no usage chunk")
            return f"{len(chunks)} chunks, usage {chunks[-1].usage.completion_tokens} tokens"

        def n_choices() -> str:
            r = client.chat.completions.create(model=MODEL, messages=[self.user(QUESTIONS[0], image=True)], n=3,
                                               max_tokens=16, temperature=1.0, seed=1)
            expect(len(r.choices) == 3 and all(c.message.content for c in r.choices), "not 3 answers")
            return f"{len(r.choices)} choices, {len({c.message.content for c in r.choices})} distinct"

        def logprobs() -> str:
            r = client.chat.completions.create(model=MODEL, messages=[self.user(QUESTIONS[1])], max_tokens=8,
                                               logprobs=True, top_logprobs=3)
            content = r.choices[0].logprobs.content
            expect(content and all(len(t.top_logprobs) == 3 for t in content), "no logprobs with 3 alternatives")
            return f"{len(content)} tokens x 3 top logprobs"

        def parse() -> str:
            return refused(lambda: client.chat.completions.parse(
                model=MODEL, messages=[self.user(QUESTIONS[0])], response_format=Person, max_tokens=16),
                "response_format")

        def tools() -> str:
            return refused(lambda: client.chat.completions.create(
                model=MODEL, messages=[self.user("what is the weather in paris ?", image=True)], tools=[WEATHER],
                max_tokens=16), "tools")

        def responses() -> str:
            first = client.responses.create(model=MODEL, max_output_tokens=32, input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": self.image_url}, {"type": "input_text", "text": QUESTIONS[0]}]}])
            second = client.responses.create(model=MODEL, max_output_tokens=32, previous_response_id=first.id,
                                             input=QUESTIONS[1])
            cached = second.usage.input_tokens_details.cached_tokens
            expect(first.output_text and second.output_text and cached > 0, f"cached tokens {cached}")
            return f"previous_response_id continued: {cached} cached tokens"

        def responses_stream() -> str:
            events = list(client.responses.create(model=MODEL, input=QUESTIONS[0], max_output_tokens=16, stream=True))
            kinds = [e.type for e in events]
            expect(kinds[-1] == "response.completed" and "response.output_text.delta" in kinds, f"events {kinds}")
            return f"{len(events)} events, ends {kinds[-1]}"

        for name, fn in [("image chat, 3 turns", image_chat), ("streaming + usage", streaming),
                         ("n=3", n_choices), ("logprobs, top_logprobs=3", logprobs),
                         (".parse(response_format=Model)", parse), ("tools (with an image)", tools),
                         ("responses + previous_response_id", responses), ("responses, streamed", responses_stream)]:
            self.run("openai", "openai", name, fn)

    # -- litellm -------------------------------------------------------------------------------------
    def litellm(self) -> None:
        import litellm

        def call(**kwargs):
            return litellm.completion(model=f"openai/{MODEL}", api_base=self.server.v1, api_key="none",
                                      max_tokens=kwargs.pop("max_tokens", 32), **kwargs)

        def image_chat() -> str:
            messages = [self.user(QUESTIONS[0], image=True)]
            first = call(messages=messages)
            messages += [{"role": "assistant", "content": first.choices[0].message.content}, self.user(QUESTIONS[1])]
            second = call(messages=messages)
            cached = second.usage.prompt_tokens_details.cached_tokens
            expect(second.choices[0].message.content and cached, f"cached tokens {cached}")
            return f"2 turns, turn 2 cached {cached} tokens"

        def streaming() -> str:
            text = "".join(c.choices[0].delta.content or "" for c in
                           call(messages=[self.user(QUESTIONS[0], image=True)], stream=True))
            expect(text, "no text")
            return f"{len(text)} characters streamed"

        def n_logprobs() -> str:
            r = call(messages=[self.user(QUESTIONS[1])], n=2, logprobs=True, top_logprobs=2, max_tokens=8)
            expect(len(r.choices) == 2 and r.choices[0].logprobs, "not 2 choices with logprobs")
            return "2 choices with logprobs"

        def structured() -> str:
            return refused(lambda: call(messages=[self.user(QUESTIONS[0])], response_format=Person), "response_format")

        def tools() -> str:
            return refused(lambda: call(messages=[self.user("what is the weather in paris ?")], tools=[WEATHER]),
                           "tools")

        for name, fn in [("image chat, 2 turns", image_chat), ("streaming", streaming),
                         ("n=2 + logprobs", n_logprobs), ("response_format=Model", structured), ("tools", tools)]:
            self.run("litellm", "litellm", name, fn)

    # -- langchain-openai -----------------------------------------------------------------------------
    def langchain(self) -> None:
        from langchain_core.messages import AIMessage, HumanMessage
        from langchain_openai import ChatOpenAI

        def chat(**kwargs) -> ChatOpenAI:
            return ChatOpenAI(model=MODEL, base_url=self.server.v1, api_key="none", max_tokens=32, temperature=0,
                              **kwargs)

        image = HumanMessage(content=[{"type": "text", "text": QUESTIONS[0]},
                                      {"type": "image_url", "image_url": {"url": self.image_url}}])

        def image_chat() -> str:
            first = chat().invoke([image])
            second = chat().invoke([image, AIMessage(content=first.content), HumanMessage(content=QUESTIONS[1])])
            cached = (second.usage_metadata or {}).get("input_token_details", {}).get("cache_read")
            expect(first.content and second.content and cached, f"cached tokens {cached}")
            return f"2 turns, turn 2 cache_read {cached}"

        def streaming() -> str:
            chunks = list(chat().stream([image]))
            expect("".join(str(c.content) for c in chunks), "no text")
            return f"{len(chunks)} chunks"

        def logprobs() -> str:
            r = chat(logprobs=True).invoke([HumanMessage(content=QUESTIONS[1])])
            expect(r.response_metadata.get("logprobs"), "no logprobs in response_metadata")
            return f"{len(r.response_metadata['logprobs']['content'])} tokens with logprobs"

        def structured() -> str:
            return refused(lambda: chat().with_structured_output(Person).invoke(QUESTIONS[0]), "response_format")

        def tools() -> str:
            return refused(lambda: chat().bind_tools([WEATHER]).invoke([image]), "tools")

        for name, fn in [("image chat, 2 turns", image_chat), ("streaming (image)", streaming),
                         ("logprobs", logprobs), ("with_structured_output(Model)", structured),
                         ("bind_tools (with an image)", tools)]:
            self.run("langchain", "langchain-openai", name, fn)

    # -- instructor -----------------------------------------------------------------------------------
    def instructor(self) -> None:
        import instructor
        from openai import OpenAI

        def patched(mode: instructor.Mode):
            return instructor.from_openai(OpenAI(base_url=self.server.v1, api_key="none"), mode=mode)

        def plain() -> str:      # response_model=None: the client passes the call through
            r = patched(instructor.Mode.TOOLS).chat.completions.create(
                model=MODEL, messages=[self.user(QUESTIONS[0], image=True)], response_model=None, max_tokens=16)
            expect(r.choices[0].message.content, "an empty answer")
            return "an answer"

        for mode, field in [(instructor.Mode.JSON_SCHEMA, "response_format"), (instructor.Mode.JSON, "response_format"),
                            (instructor.Mode.TOOLS, "tools")]:
            def check(mode=mode, field=field) -> str:
                return refused(lambda: patched(mode).chat.completions.create(
                    model=MODEL, messages=[self.user(QUESTIONS[0])], response_model=Person, max_tokens=16,
                    max_retries=0), field)
            self.run("instructor", "instructor", f"response_model, Mode.{mode.name}", check)
        self.run("instructor", "instructor", "response_model=None (image)", plain)

    # -- SGLang's frontend language -------------------------------------------------------------------
    def sglang(self) -> None:
        import sglang as sgl

        @sgl.function
        def image_chat(s, image_path: str, questions: tuple[str, ...]):
            s += sgl.user(sgl.image(image_path) + questions[0])
            s += sgl.assistant(sgl.gen("answer_0", max_tokens=32, temperature=0))
            for i, question in enumerate(questions[1:], 1):
                s += sgl.user(question)
                s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=32, temperature=0))

        @sgl.function
        def pick(s, question: str):
            s += sgl.user(question)
            s += sgl.assistant(sgl.select("colour", choices=["red", "green", "blue"]))

        def runtime(stream: bool) -> Callable[[], str]:
            def check() -> str:
                backend = sgl.RuntimeEndpoint(self.server.url)
                state = image_chat.run(image_path=str(self.image_path), questions=QUESTIONS, backend=backend,
                                       stream=stream)
                if stream:
                    for _ in state.text_iter():
                        pass
                answers = [state[f"answer_{i}"] for i in range(len(QUESTIONS))]
                expect(all(answers), f"answers {answers}")
                return f"template {backend.chat_template.name}, 3 answers"
            return check

        def select() -> str:     # each choice scored by a batch of prompts with return_logprob
            state = pick.run(question=QUESTIONS[1], backend=sgl.RuntimeEndpoint(self.server.url))
            expect(state.error() is None, state.error())
            expect(state["colour"] in ("red", "green", "blue"), f"selected {state['colour']!r}")
            scores = state.get_meta_info("colour")["normalized_prompt_logprobs"]
            return f"selected {state['colour']!r} (normalized logprobs {', '.join(f'{x:.2f}' for x in scores)})"

        def openai_backend() -> str:
            # the backend loads tiktoken's cl100k_base, which tiktoken downloads; litellm ships the file and points
            # tiktoken at it when this module is imported (this machine reaches no download site)
            import litellm.litellm_core_utils.default_encoding  # noqa: F401

            backend = sgl.OpenAI(MODEL, is_chat_model=True, base_url=self.server.v1, api_key="none")
            state = image_chat.run(image_path=str(self.image_path), questions=QUESTIONS[:2], backend=backend)
            expect(state["answer_0"] and state["answer_1"], "empty answers")
            return "2 answers"

        for name, fn in [("RuntimeEndpoint, image, 3 turns", runtime(False)),
                         ("RuntimeEndpoint, streamed", runtime(True)), ("sgl.select (batched scoring)", select),
                         ("OpenAI backend, image, 2 turns", openai_backend)]:
            self.run("sglang", "sglang", name, fn)

    # -- structured outputs and tools, on a model that can write them ---------------------------------
    def tools_and_schemas(self, server: Server) -> None:
        """Each client's structured output and tool call answered (TOOL_MODEL on `server`), with an image where
        the client sends one."""
        import instructor
        import litellm
        from langchain_core.messages import HumanMessage
        from langchain_openai import ChatOpenAI
        from openai import OpenAI

        client = OpenAI(base_url=server.v1, api_key="none")
        ask = [self.user("what is the weather in paris ?", image=True)]

        def called(calls: list, name: str = "get_weather") -> str:
            expect(calls and calls[0].function.name == name, f"calls {calls}")
            return f"called {name}({calls[0].function.arguments})"

        def chat(**kwargs) -> ChatOpenAI:
            return ChatOpenAI(model=TOOL_MODEL, base_url=server.v1, api_key="none", max_tokens=200, **kwargs)

        image = HumanMessage(content=[{"type": "text", "text": "what is the weather in paris ?"},
                                      {"type": "image_url", "image_url": {"url": self.image_url}}])
        checks = [
            ("openai", "openai", ".parse(response_format=Model)", lambda: parsed(client.chat.completions.parse(
                model=TOOL_MODEL, messages=ask, response_format=Person, max_tokens=200).choices[0].message.parsed)),
            ("openai", "openai", "tools, required (with an image)", lambda: called(client.chat.completions.create(
                model=TOOL_MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                max_tokens=200).choices[0].message.tool_calls)),
            ("openai", "openai", ".stream(response_format=Model)", lambda: streamed_parse(client, ask)),
            ("openai", "openai", "responses + tools, required", lambda: responses_call(client, ask)),
            ("litellm", "litellm", "response_format=Model", lambda: parsed(Person.model_validate_json(
                litellm.completion(model=f"openai/{TOOL_MODEL}", api_base=server.v1, api_key="none", messages=ask,
                                   response_format=Person, max_tokens=200).choices[0].message.content))),
            ("litellm", "litellm", "tools, required", lambda: called(litellm.completion(
                model=f"openai/{TOOL_MODEL}", api_base=server.v1, api_key="none", messages=ask, tools=[WEATHER],
                tool_choice="required", max_tokens=200).choices[0].message.tool_calls)),
            ("langchain", "langchain-openai", "with_structured_output(Model)",
             lambda: parsed(chat().with_structured_output(Person).invoke([image]))),
            ("langchain", "langchain-openai", "with_structured_output, function_calling",
             lambda: parsed(chat().with_structured_output(Person, method="function_calling").invoke([image]))),
            ("langchain", "langchain-openai", "bind_tools (with an image)", lambda: tool_called(
                chat().bind_tools([WEATHER], tool_choice="get_weather").invoke([image]).tool_calls)),
        ]
        for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
            checks.append(("instructor", "instructor", f"response_model, Mode.{mode.name}",
                           lambda mode=mode: parsed(instructor.from_openai(client, mode=mode).chat.completions.create(
                               model=TOOL_MODEL, messages=ask, response_model=Person, max_tokens=200,
                               max_retries=0))))
        previous = self.server
        self.server = server              # the 5xx count is the tool model's server's
        try:
            for name, distribution, check, fn in checks:
                self.run(name, distribution, f"{TOOL_MODEL}: {check}", fn)
        finally:
            self.server = previous

    # -- lm-eval-harness ------------------------------------------------------------------------------
    def lm_eval(self, after_sessions: int) -> None:
        completions = (f"model={MODEL},base_url={self.server.v1}/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={ROOT / 'models' / 'demo-v2'},num_concurrent=2,max_retries=1,max_length=1024")
        chat = f"model={MODEL},base_url={self.server.v1}/chat/completions,num_concurrent=2,max_retries=1"
        self.run("lm-eval", "lm-eval", "local-completions multiple_choice",
                 lambda: harness("local-completions", completions, "raincheck_mc"))
        self.run("lm-eval", "lm-eval", "local-completions generate_until",
                 lambda: harness("local-completions", completions, "raincheck_gen"))
        self.run("lm-eval", "lm-eval", "local-chat-completions generate_until",
                 lambda: harness("local-chat-completions", chat, "raincheck_gen", "--apply_chat_template"))

        def after_idle_sessions() -> str:
            from openai import OpenAI

            client = OpenAI(base_url=self.server.v1, api_key="none")
            for i in range(after_sessions):    # each conversation a session, idle after its answer
                client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
                    self.user(f"what is in row {i % 12 + 1} column {i // 12 + 1} ? ({i})")])
            return f"after {after_sessions} chat sessions: " + harness("local-completions", completions,
                                                                        "raincheck_mc")
        self.run("lm-eval", "lm-eval", f"multiple_choice after {after_sessions} sessions", after_idle_sessions)


def streamed_parse(client: OpenAI, messages: list[dict]) -> str:
    with client.chat.completions.stream(model=TOOL_MODEL, messages=messages, response_format=Person,
                                        max_tokens=200) as stream:
        return parsed(stream.get_final_completion().choices[0].message.parsed)


def parsed(value: object) -> str:
    expect(isinstance(value, Person), f"not a Person: {value!r}")
    return f"parsed {value!r}"[:90]


def responses_call(client: OpenAI, messages: list[dict]) -> str:
    """The Responses API's flat function tool, its image as an input_image part."""
    text, image = messages[0]["content"][1]["text"], messages[0]["content"][0]["image_url"]["url"]
    content = [{"type": "input_image", "image_url": image}, {"type": "input_text", "text": text}]
    r = client.responses.create(model=TOOL_MODEL, max_output_tokens=200, tool_choice="required",
                                input=[{"role": "user", "content": content}],
                                tools=[{"type": "function", **WEATHER["function"]}])
    calls = [item for item in r.output if item.type == "function_call"]
    expect(calls and calls[0].name == "get_weather", f"output {r.output}")
    return f"function_call get_weather({calls[0].arguments})"


def tool_called(calls: list[dict]) -> str:
    """langchain's tool calls (dicts with parsed args)."""
    expect(calls and calls[0]["name"] == "get_weather", f"calls {calls}")
    return f"called get_weather({calls[0]['args']})"


def harness(model: str, model_args: str, task: str, *extra: str) -> str:
    """lm-eval's command line on one vendored task, run to its end; its metric as the detail."""
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
                              "--tasks", task, "--include_path", str(TASKS), "--output_path", out, *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
        expect(run.returncode == 0, f"lm_eval exited {run.returncode}: {run.stderr[-600:]}")
        results = [json.loads(p.read_text()) for p in Path(out).rglob("results_*.json")]
        expect(results, "no results file")
    metrics = results[0]["results"][task]
    shown = {k.split(",")[0]: round(v, 3) for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k}
    return ", ".join(f"{k} {v}" for k, v in shown.items())


def markdown(results: list[Result]) -> str:
    rows = ["| client | version | check | result |", "|---|---|---|---|"]
    rows += [f"| {r.client} | {r.version} | {r.check} | {'pass' if r.ok else 'FAIL'}: {r.detail.replace('|', '/')} |"
             for r in results]
    return "\n".join(rows) + "\n"


# "tools": structured outputs and tool calls answered, on a tiny random model (TOOL_MODEL) started after the demo
CLIENTS = ("openai", "litellm", "langchain", "instructor", "sglang", "lm_eval", "tools")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--server-python", help="start `raincheck serve` (demo model) with this interpreter")
    where.add_argument("--url", help="a server already running (its HTTP API's root)")
    parser.add_argument("--image", type=Path, help="the image of the image chats (default: a demo scene, "
                        "rendered with --server-python)")
    parser.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    parser.add_argument("--sessions", type=int, default=100, help="idle chat sessions before lm-eval runs again")
    parser.add_argument("--markdown", type=Path, nargs="?", const=Path(sys.prefix) / "conformance.markdown",
                        help="write the table here (no path: conformance.markdown in this venv)")
    args = parser.parse_args(argv)
    if args.image is None and args.server_python is None:
        parser.error("--url needs --image")
    with tempfile.TemporaryDirectory() as tmp:
        image = args.image or Path(tmp) / "scene.png"
        if args.image is None:
            scene(args.server_python, image)
        with local_server(args.server_python) if args.server_python else nullcontext(args.url) as url:
            checks = Checks(Server(url.rstrip("/")), image)
            for name in args.clients:
                if name == "lm_eval":
                    checks.lm_eval(args.sessions)
                elif name != "tools":
                    getattr(checks, name)()
        if args.server_python and "tools" in args.clients:
            tool_model(args.server_python, Path(tmp) / "tool-model")
            with local_server(args.server_python, "--model", str(Path(tmp) / "tool-model"),
                              "--model-name", TOOL_MODEL) as url:
                checks.tools_and_schemas(Server(url))
    table = markdown(checks.results)
    print("\n" + table)
    if args.markdown:
        args.markdown.write_text(table)
    failed = [r for r in checks.results if not r.ok]
    print(f"{len(checks.results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
