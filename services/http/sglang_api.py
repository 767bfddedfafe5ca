"""SGLang's native API: `POST /generate` and `GET /get_model_info`, as SGLang's frontend language
(`RuntimeEndpoint`) drives them.

`text` is the whole program so far, rendered with SGLang's `qwen2-vl` chat template: ChatML turns
(`<|im_start|>role\\n...<|im_end|>\\n`) ending with the generation prompt `<|im_start|>assistant\\n`, one
`<|vision_start|><|image_pad|><|vision_end|>` per image, and `image_data` holding the images in order
(base64, a data URL, or an http(s) URL where allowed). It is parsed into turns and matched to sessions
exactly like a chat completion. `sampling_params` follow SGLang's names: the penalties, `min_p`,
`min_new_tokens`, `stop_token_ids`, `logit_bias`, `json_schema` and the special tokens' decoding are honoured as
in the OpenAI API; those a session cannot honour (`n`, regex, ebnf, structural tags, ...) are refused unless
neutral. Requests with
`max_new_tokens: 0` (SGLang's "cache this prefix") are answered without running anything: the prefix is
prefilled with its turn. With `return_logprob` too they are scoring (`sgl.select` scores each choice so): each
prompt, a text or token ids, alone or in a batch, is a stateless completion that echoes its tokens' logprobs
(the worker's Complete, as lm-eval's loglikelihood through /v1/completions). Otherwise batches, `input_ids`
and logprobs are not supported.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict

from raincheck_client._gen import chat_pb2
from raincheck_core.grammar import json_schema_grammar

from ..common.events import read
from ..common.grpc_util import ServiceError
from .completions import MAX_PROMPTS
from .conversation import RoleMessage, group_turns
from .errors import HttpError
from .images import ImageLoader
from .openai_fields import SessionKnobs, deferral_of
from .sampling_fields import logit_bias, stop_strings
from .session_matching import Done, TurnSpec

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
GENERATION_PROMPT = "<|im_start|>assistant\n"
_MESSAGE = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>\n?", re.S)
# SGLang sampling parameters a session cannot honour, with the value that means "off"
_NEUTRAL: dict[str, Any] = {"n": 1, "stop_regex": None, "regex": None, "ebnf": None, "structural_tag": None,
                            "custom_params": None}
_IGNORED = ("stream_interval",)
_USED = ("max_new_tokens", "stop", "temperature", "top_p", "top_k", "ignore_eos", "no_stop_trim", "sampling_seed",
         "min_new_tokens", "stop_token_ids", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
         "json_schema", "logit_bias", "skip_special_tokens", "spaces_between_special_tokens")
# SGLang's names of the engine's sampling rules (SamplingOptions fields)
_RULES = {"min_new_tokens": "min_tokens", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
          "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty"}
TOP_K_ALL = 1 << 30                       # SGLang's "no top-k"


class _Generate(BaseModel):
    text: str | list[str] | None = None
    input_ids: Any = None
    image_data: str | list[str] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | None = None
    return_logprob: bool | None = None
    logprob_start_len: int = -1           # scoring: the first prompt position whose logprob is returned (-1: none)
    return_text_in_logprobs: bool = False
    top_logprobs_num: int = 0
    # Raincheck's own
    model: str | None = None              # needed only where several models are served


class GenerateRequest(SessionKnobs, _Generate):
    """SGLang's fields, then Raincheck's: the model, and the session knobs (openai_fields.SESSION_KNOBS;
    pydantic orders the fields of the last base first). Other fields are ignored, as SGLang does."""

    model_config = ConfigDict(extra="ignore")


def prefill_only(r: GenerateRequest) -> bool:
    return (r.sampling_params or {}).get("max_new_tokens") == 0


def check(r: GenerateRequest) -> None:
    if r.input_ids is not None or not isinstance(r.text, str):
        raise HttpError.invalid("text must be one string (input_ids and batches are scored only: max_new_tokens 0 "
                                "with return_logprob)", param="text")
    if r.return_logprob:
        raise HttpError.invalid("return_logprob needs max_new_tokens 0 (scoring): answers' logprobs are not "
                                "supported", param="return_logprob")


def scoring(r: GenerateRequest) -> bool:
    """SGLang's scoring request: no new tokens, the prompts' logprobs."""
    return prefill_only(r) and bool(r.return_logprob)


def score_requests(r: GenerateRequest, model: str) -> list[chat_pb2.CompleteRequest]:
    """One stateless completion per prompt (a text, token ids, or a batch of either) that generates nothing and
    echoes each prompt token with its logprob; 400 naming the field for what scoring cannot take."""
    if r.image_data:
        raise HttpError.unsupported("image_data cannot be scored: scoring takes text or token ids", "image_data")
    if r.top_logprobs_num:
        raise HttpError.unsupported("top_logprobs_num is not supported in scoring", "top_logprobs_num")
    if (r.text is None) == (r.input_ids is None):
        raise HttpError.invalid("scoring takes text or input_ids", param="text")
    field, value = ("text", r.text) if r.text is not None else ("input_ids", r.input_ids)
    prompts = value if batched(r) else [value]
    if not (isinstance(prompts, list) and 0 < len(prompts) <= MAX_PROMPTS and all(
            (isinstance(p, str) and p) if field == "text" else
            (isinstance(p, list) and p and all(isinstance(t, int) for t in p)) for p in prompts)):
        raise HttpError.invalid(f"{field} is one prompt or a batch of 1-{MAX_PROMPTS} non-empty prompts"
                                + (" (token ids)" if field == "input_ids" else ""), param=field)
    sampling = chat_pb2.SamplingOptions(max_new_tokens=0, temperature=0)
    return [chat_pb2.CompleteRequest(model=model, sampling=sampling, echo=True, prompt_logprobs=0,
                                     **({"text": p} if field == "text" else {"token_ids": p})) for p in prompts]


def batched(r: GenerateRequest) -> bool:
    """A batch of prompts (answered by a list, one prompt by its object, as SGLang does)."""
    if r.text is not None:
        return isinstance(r.text, list)
    return isinstance(r.input_ids, list) and bool(r.input_ids) and isinstance(r.input_ids[0], list)


def prompt_of(events: Iterable[chat_pb2.ChatEvent]) -> chat_pb2.PromptTokens:
    """A scoring completion's prompt tokens with their logprobs (its stream run to the end)."""
    prompt = None
    for part in read(events):
        if isinstance(part, chat_pb2.PromptTokens):
            prompt = part
    if prompt is None:
        raise ServiceError(grpc.StatusCode.INTERNAL, "the scoring completion ended without its prompt's tokens")
    return prompt


def score_body(prompt: chat_pb2.PromptTokens, r: GenerateRequest) -> dict:
    """One prompt's scoring answer: `input_token_logprobs` from `logprob_start_len` on, each (logprob, token id,
    its text when asked); the first prompt token has no logprob (None), as in SGLang."""
    start = len(prompt.tokens) if r.logprob_start_len < 0 else r.logprob_start_len
    logprobs = [[t.logprob if i else None, t.token_id, t.token if r.return_text_in_logprobs else None]
                for i, t in enumerate(prompt.tokens) if i >= start]
    return {"text": "", "meta_info": {"id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 0},
                                      "prompt_tokens": len(prompt.tokens), "completion_tokens": 0, "cached_tokens": 0,
                                      "input_token_logprobs": logprobs, "output_token_logprobs": []}}


async def to_spec(r: GenerateRequest, model: str, images: ImageLoader, default_max_new_tokens: int) -> TurnSpec:
    check(r)
    refs = [r.image_data] if isinstance(r.image_data, str) else list(r.image_data or [])
    loaded = [await images.load(ref, f"image_data[{i}]", bare_base64=True) for i, ref in enumerate(refs)]
    messages = parse_chatml(r.text, loaded)
    sampling, stop, keep_stop = _sampling(r.sampling_params or {}, default_max_new_tokens)
    return TurnSpec(model, group_turns(messages), sampling, deferral_of(r), r.recovery_mode, stop, keep_stop,
                    grammar_field="sampling_params.json_schema" if sampling.grammar else None)


def parse_chatml(text: str, images: list[bytes]) -> list[RoleMessage]:
    """ChatML turns ending with the generation prompt -> role messages with their images (400 otherwise)."""
    if not text.endswith(GENERATION_PROMPT):
        raise HttpError.invalid("text must end with the generation prompt '<|im_start|>assistant\\n': render the "
                                "conversation with the qwen2-vl chat template", param="text")
    body, pos, messages, used = text[:-len(GENERATION_PROMPT)], 0, [], 0
    while pos < len(body):
        m = _MESSAGE.match(body, pos)
        if m is None:
            raise HttpError.invalid(f"text is not a ChatML conversation at character {pos}: {body[pos:pos + 40]!r}",
                                    param="text")
        role, content = m.group(1), m.group(2)
        n = content.count(IMAGE)
        if n and role != "user":
            raise HttpError.invalid(f"only user messages hold images (an image placeholder in a {role} turn)",
                                    param="text")
        messages.append(RoleMessage(role, content.replace(IMAGE, ""), tuple(images[used:used + n])))
        used += n
        pos = m.end()
    if used != len(images):
        raise HttpError.invalid(f"text has {used} image placeholders ({IMAGE}) for {len(images)} image_data "
                                "entries", param="image_data")
    return messages


def _sampling(p: dict[str, Any], default_max_new_tokens: int) -> tuple[chat_pb2.SamplingOptions, list[str], bool]:
    for name, value in p.items():
        if name in _NEUTRAL:
            if value not in (None, [], {}, "") and value != _NEUTRAL[name]:
                raise HttpError.unsupported(f"sampling_params.{name} = {value!r} is not supported",
                                            param=f"sampling_params.{name}")
        elif name not in _IGNORED and name not in _USED:
            raise HttpError.invalid(f"unknown sampling parameter {name!r}", param=f"sampling_params.{name}",
                                    code="unknown_parameter")
    top_k = p.get("top_k")
    options = chat_pb2.SamplingOptions(
        temperature=p.get("temperature", 1.0), top_p=p.get("top_p"), seed=p.get("sampling_seed"),
        top_k=top_k if top_k is not None and 0 < top_k < TOP_K_ALL else None,
        max_new_tokens=p.get("max_new_tokens") or default_max_new_tokens, ignore_eos=bool(p.get("ignore_eos")))
    for name, field in _RULES.items():
        if p.get(name) is not None:
            setattr(options, field, p[name])
    if p.get("skip_special_tokens") is False:    # the worker decodes the answer again, special tokens kept
        options.skip_special_tokens = False
        options.spaces_between_special_tokens = p.get("spaces_between_special_tokens") is not False
    options.stop_token_ids.extend(p.get("stop_token_ids") or [])
    options.logit_bias.update(logit_bias(p.get("logit_bias") or {}))
    if p.get("json_schema"):
        try:
            options.grammar = json_schema_grammar(json.loads(p["json_schema"]))
        except (TypeError, json.JSONDecodeError) as e:
            raise HttpError.invalid(f"sampling_params.json_schema is a JSON schema as a string: {e}",
                                    param="sampling_params.json_schema") from None
    return options, stop_strings(p.get("stop")), bool(p.get("no_stop_trim"))


def generate_body(done: Done, rid: str | None, text: str | None = None) -> dict:
    """`/generate`'s response (and each streamed chunk: `text` so far, meta_info complete only at the end)."""
    u = done.usage
    if done.finish_reason == "length":
        finish = {"type": "length", "length": u.completion_tokens}
    else:
        finish = {"type": "stop", "matched": done.matched_stop}
    return {"text": done.text if text is None else text,
            "meta_info": {"id": rid or uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": u.prompt_tokens,
                          "completion_tokens": u.completion_tokens, "cached_tokens": u.cached_tokens,
                          "raincheck": done.details()}}


def partial_body(text: str, rid: str) -> dict:
    return {"text": text, "meta_info": {"id": rid, "finish_reason": None}}


def count_request(r: GenerateRequest, model: str) -> chat_pb2.TokenizeRequest | None:
    """What counts a prefill-only request's tokens (sgl.select scores from its `prompt_tokens` on), as scoring
    tokenizes them; None with images, whose tokens only the worker's image processor counts."""
    return None if r.image_data else chat_pb2.TokenizeRequest(model=model, text=r.text)


def prefill_only_body(rid: str | None, prompt_tokens: int) -> dict:
    """`prompt_tokens`: the text's tokens (0 with images: see count_request)."""
    return {"text": "", "meta_info": {"id": rid or uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 0},
                                      "prompt_tokens": prompt_tokens, "completion_tokens": 0, "cached_tokens": 0}}


# SGLang's name of the chat template `/generate` reads (what `text` must be rendered with)
CHAT_TEMPLATE = "qwen2-vl"


def model_info(model: str) -> dict:
    """`/get_model_info`. `RuntimeEndpoint` picks its chat template by matching `model_path` against model names
    (`qwen.*vl` is qwen2-vl), so `model_path` is the template's name, the one `/generate` parses; the served
    model's name is `served_model_name`."""
    return {"model_path": CHAT_TEMPLATE, "tokenizer_path": CHAT_TEMPLATE, "served_model_name": model,
            "chat_template": CHAT_TEMPLATE, "is_generation": True}
