"""Tokenizer + chat template: one turn's `Message` -> `Prompt` (token ids with visual placeholders + visuals).

Multi-turn sessions keep their KV cache, so each turn feeds only its *new* tokens. The engine keeps the
previous answer's sampled ids and its closing stop token (`turn_end_id`, `<|im_end|>` for Qwen), and
prefills that stop token at the start of the next turn. A later turn therefore renders only what the
template puts after that token. We find it by rendering a probe conversation
`[user "…", assistant SENTINEL, new message]` and cutting right after `SENTINEL + <|im_end|>`, which gives
`\\n<|im_start|>user\\n…<|im_end|>\\n<|im_start|>assistant\\n` for Qwen's ChatML. So

    prompt(turn 1) + answer ids + [turn_end_id] + prompt(turn 2) + … == tokenize(template(whole conversation))

as long as the template renders earlier turns the same way whatever follows (it does not rewrite history,
e.g. strip `<think>` blocks from past answers) and tokenization does not merge across special tokens
(Hugging Face tokenizers split at added special tokens first, so it does not). The cut is found at the
probe's own SENTINEL, the first occurrence in the render: the templates render messages in order, so
nothing in the new message (which comes after it) can move the cut.

A message's `RenderOptions` give the template extra variables (`enable_thinking`, ...) and its images a
pixel range and its videos a frame rate; they are checked here (`InvalidInputError` naming the option).
`chat_prompt` renders a whole chat at once (tools, tool results, images), for completions outside sessions.

Control tokens in user text are refused (`InvalidInputError` naming the token): Hugging Face tokenizers
match every special or added token (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, `<|image_pad|>`, …)
inside plain text, so a message containing one could forge a system or assistant turn, or a visual
placeholder. Refusing is the documented behaviour (docs/services.md, Errors); rendering such text as
plain characters would need the user's text tokenized apart from the template's, which changes how it
tokenizes next to the template's text.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError, UnsupportedModelError
from ..inputs import Message, Prompt, RenderOptions, VisualInput
from .turn_input import MessageMarks
from .vision import VisionEncoder

TURN_END = "<|im_end|>"


_SENTINEL = "RAINCHECKPREVIOUSANSWER"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def chatml_template(default_system: str | None = None,
                    vision_tokens: tuple[str, str, str, str] = ("<|image_pad|>", "<|video_pad|>",
                                                                "<|vision_start|>", "<|vision_end|>")) -> str:
    """Qwen's ChatML as a Jinja chat template, visuals as typed content parts (the shape Qwen2-VL/Qwen3-VL
    ship), optionally with a default system prompt. The engine's fallback for tokenizers without a template,
    and the template of the checkpoints this project writes itself (demo, random and test models)."""
    image_pad, video_pad, vs, ve = vision_tokens
    system = ("{%- if messages[0].role != 'system' %}"
              f"{{{{ '<|im_start|>system\\n{default_system}<|im_end|>\\n' }}}}{{%- endif %}}"
              if default_system else "")
    return (system
            + "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
            "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for c in message.content %}"
            f"{{%- if c.type == 'image' %}}{vs}{image_pad}{ve}"
            f"{{%- elif c.type == 'video' %}}{vs}{video_pad}{ve}"
            "{%- elif c.type == 'text' %}{{ c.text }}{%- endif %}{%- endfor %}{%- endif %}"
            "{{ '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


class ChatFormatter:
    """Renders turns with the checkpoint's chat template (or built-in Qwen ChatML) and tokenizes them."""

    def __init__(self, tokenizer, chat_template: str | None = None, *, eos_token_ids: Sequence[int] = (),
                 template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # None: built-in ChatML
        self.template_kwargs = dict(template_kwargs or {})  # e.g. {"enable_thinking": False}
        vocab = tokenizer.get_vocab()
        self.turn_end = TURN_END if TURN_END in vocab else tokenizer.eos_token
        if self.turn_end is None:
            raise UnsupportedModelError("the tokenizer has neither <|im_end|> nor an eos token")
        self.turn_end_id: int = tokenizer.convert_tokens_to_ids(self.turn_end)
        stops = [*eos_token_ids, tokenizer.eos_token_id, self.turn_end_id]
        self.stop_token_ids: list[int] = list(dict.fromkeys(s for s in stops if s is not None))
        # what the tokenizer matches as one token anywhere in a text (longest first, for the message)
        control = {t for t in [*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()] if t}
        self.control_tokens: tuple[str, ...] = tuple(sorted(control, key=lambda t: (-len(t), t)))
        self._control = re.compile("|".join(map(re.escape, self.control_tokens))) if control else None

    @classmethod
    def from_checkpoint(cls, folder: Path, *, template_kwargs: dict | None = None) -> ChatFormatter | None:
        """The folder's tokenizer and chat template; None when the folder has no tokenizer files."""
        folder = Path(folder)
        if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        return cls(tokenizer, _find_template(tokenizer, folder), eos_token_ids=_generation_eos(folder),
                   template_kwargs=template_kwargs)

    def message_marks(self, vision_end: int | None) -> MessageMarks:
        """The ids that mark this tokenizer's messages in a rendered prompt (turn_input.py `MessageMarks`)."""
        def single(text: str) -> int | None:
            ids = self.encode(text)
            return ids[0] if len(ids) == 1 else None
        return MessageMarks(vision_end, self.tokenizer.get_vocab().get("<|im_start|>"), single("system"),
                            single("user"))

    # -- text ---------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def check_text(self, text: str, reserved: Sequence[str] = ()) -> None:
        """InvalidInputError if `text` contains a control token of the tokenizer (see the module doc), or
        one of `reserved` (the model's visual placeholders, whether the tokenizer lists them or not)."""
        if not isinstance(text, str):
            raise InvalidInputError(f"message text must be a string, got {type(text).__name__}")
        found = self._control.search(text) if self._control is not None else None
        token = found.group() if found is not None else next((r for r in reserved if r in text), None)
        if token is not None:
            raise InvalidInputError(
                f"message text contains the reserved token {token!r} at character {text.index(token)}: the "
                "chat template's control tokens cannot be sent as text"
            )

    def render_turn(self, message: Message, *, first_turn: bool, image_pad: str = "<|image_pad|>",
                    video_pad: str = "<|video_pad|>", vision_start: str = "<|vision_start|>",
                    vision_end: str = "<|vision_end|>") -> str:
        """This turn's new text, with one `<|image_pad|>` / `<|video_pad|>` per image / video (unexpanded)."""
        new = {"role": message.role, "content": _content(message)}
        kwargs = self.template_kwargs_of(message.render)
        vision_tokens = (image_pad, video_pad, vision_start, vision_end)

        def render(messages: list[dict]) -> str:
            try:
                return self._render(messages, vision_tokens, kwargs)
            except Exception as e:
                if not kwargs:          # the checkpoint's own template failing on a plain turn: the server's fault
                    raise
                raise InvalidInputError(f"the chat template cannot render this turn with its chat_template_kwargs: "
                                        f"{e}") from None

        if first_turn:
            return render([new])
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}, new]
        full = render(probe)
        cut = full.find(_SENTINEL) + len(_SENTINEL)   # the probe's answer precedes the new message
        if not full.startswith(self.turn_end, cut):
            if kwargs:
                raise InvalidInputError("with these chat_template_kwargs the chat template does not close an "
                                        "assistant turn where a session's next turn can continue")
            raise UnsupportedModelError(
                f"the chat template does not close an assistant turn with {self.turn_end!r} right after "
                f"the answer, so a later turn cannot continue from the kept stop token "
                f"(got {full[cut:cut + 40]!r})"
            )
        return full[cut + len(self.turn_end):]

    def _render(self, messages: list[dict], vision_tokens: tuple[str, str, str, str], kwargs: dict | None = None,
                *, tools: list | None = None, add_generation_prompt: bool = True, continue_final: bool = False) -> str:
        template = self.chat_template or chatml_template(vision_tokens=vision_tokens)
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
            **{**self.template_kwargs, **(kwargs or {})},
        )

    # -- render options ----------------------------------------------------------------------------------

    def template_kwargs_of(self, render: RenderOptions) -> dict:
        """`render`'s template variables, checked: not one of the template's own arguments or the special
        tokens it reads (they would change what the template is, not how it renders a chat), and no control
        token in any of their strings (a template may print them)."""
        kwargs = render.template_kwargs
        if not kwargs:
            return {}
        if not isinstance(kwargs, dict):
            raise InvalidInputError("chat_template_kwargs is an object of template variables")
        reserved = {*inspect.signature(self.tokenizer.apply_chat_template).parameters,
                    *getattr(self.tokenizer, "SPECIAL_TOKENS_ATTRIBUTES", ()), *self.tokenizer.special_tokens_map,
                    "conversation", "messages", "tools", "documents", "additional_special_tokens"}
        for name, value in kwargs.items():
            if not (isinstance(name, str) and name.isidentifier()) or name in reserved:
                raise InvalidInputError(f"chat_template_kwargs cannot set {name!r}: it is not a template variable "
                                        "a request may set")
            for text in _strings(value):
                found = self._control.search(text) if self._control is not None else None
                if found is not None:
                    raise InvalidInputError(f"chat_template_kwargs.{name} contains the reserved token "
                                            f"{found.group()!r}: the chat template's control tokens cannot be sent")
        return dict(kwargs)

    @staticmethod
    def _pixels(render: RenderOptions, vision: VisionEncoder) -> tuple[int | None, int | None]:
        """The pixel range images are resized into (None: the checkpoint's), checked against the checkpoint's
        own largest: a request may shrink images or enlarge small ones, never past what the model takes."""
        lo, hi = render.min_pixels, render.max_pixels
        most = vision.image_processor.size.longest_edge
        for name, value in (("min_pixels", lo), ("max_pixels", hi)):
            if value is not None and not 0 < value <= most:
                raise InvalidInputError(f"mm_processor_kwargs.{name} must be in [1, {most}] (this model's "
                                        f"max_pixels); got {value}")
        if lo is not None and hi is not None and lo > hi:
            raise InvalidInputError(f"mm_processor_kwargs.min_pixels ({lo}) is more than max_pixels ({hi})")
        return lo, hi

    @staticmethod
    def _fps(render: RenderOptions) -> float | None:
        if render.fps is not None and not (math.isfinite(render.fps) and render.fps > 0):
            raise InvalidInputError(f"mm_processor_kwargs.fps must be positive; got {render.fps}")
        return render.fps

    # -- prompt -------------------------------------------------------------------------------------------

    def build_prompt(self, message: Message, *, first_turn: bool, vision: VisionEncoder | None,
                     image_token_id: int | None, video_token_id: int | None, vision_start_id: int | None,
                     vision_end_id: int | None, selection_signals: bool = False) -> Prompt:
        """Render, encode the visuals, expand each placeholder to its visual tokens, tokenize.
        `selection_signals`: the encoder also returns what attention-based selectors read."""
        ids = (image_token_id, video_token_id, vision_start_id, vision_end_id)
        pads = () if None in ids else tuple(self.tokenizer.convert_ids_to_tokens(list(ids)))
        self.check_text(message.text, pads)
        has_visuals = bool(message.images or message.videos)
        if has_visuals and vision is None:
            raise InvalidInputError("this model has no vision encoder: images and videos cannot be sent")
        if not pads:
            if has_visuals:
                raise InvalidInputError("this model has no image/video token ids: visuals cannot be sent")
            return Prompt(self.encode(self.render_turn(message, first_turn=first_turn)), [])
        image_pad, video_pad, vs, ve = pads
        text = self.render_turn(message, first_turn=first_turn, image_pad=image_pad, video_pad=video_pad,
                                vision_start=vs, vision_end=ve)
        return self._visual_prompt(text, message.images, message.videos, vision, pads, message.render,
                                   selection_signals)

    def _visual_prompt(self, text: str, images: Sequence[object], videos: Sequence[Sequence[object]],
                       vision: VisionEncoder, pads: tuple[str, str, str, str], render: RenderOptions,
                       signals: bool = False) -> Prompt:
        """`text` (one placeholder per visual) with the visuals encoded and each placeholder expanded."""
        fps = self._fps(render)
        encoded: list[VisualInput] = []
        if images:
            pixels = {}               # only where asked: a layout-only encoder (raincheck_demo.data) takes none
            if render.min_pixels is not None or render.max_pixels is not None:
                pixels = dict(zip(("min_pixels", "max_pixels"), self._pixels(render, vision), strict=True))
            encoded = vision.encode_images(images, signals=signals, **pixels)
        clips = [(vision.encode_video(frames, signals=signals), len(frames)) for frames in videos]
        expanded, visuals = self._expand(text, encoded, clips, vision, *pads, fps=fps)
        return Prompt(self.encode(expanded), visuals)

    # -- a whole chat ---------------------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict], images: Sequence[object], *, vision: VisionEncoder | None,
                    image_token_id: int | None, video_token_id: int | None, vision_start_id: int | None,
                    vision_end_id: int | None, tools: list | None = None, render: RenderOptions | None = None,
                    continue_final: bool = False, add_generation_prompt: bool = True) -> Prompt:
        """A whole chat (OpenAI-style messages: system, user, assistant with tool_calls, tool results; an image
        as a `{"type": "image"}` content part, `images` the images in their order) and the tools it may call,
        as the template renders it, ready for the assistant's answer (`continue_final`: to continue its last,
        assistant message; `add_generation_prompt` false: no assistant prompt). InvalidInputError for control
        tokens in any text, a template that renders the tools or the images not at all, or fails."""
        render = render or RenderOptions()
        ids = (image_token_id, video_token_id, vision_start_id, vision_end_id)
        pads = () if None in ids else tuple(self.tokenizer.convert_ids_to_tokens(list(ids)))
        texts, image_parts = _check_chat(messages, continue_final)
        for text in [*texts, *_strings(tools or [])]:
            self.check_text(text, pads)
        if image_parts != len(images):
            raise InvalidInputError(f"the chat has {image_parts} image parts for {len(images)} images")
        if images and (vision is None or not pads):
            raise InvalidInputError("this model has no vision encoder: images cannot be sent")
        kwargs = self.template_kwargs_of(render)
        vision_tokens = pads or ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")

        def render_with(offered: list | None) -> str:
            try:
                return self._render(messages, vision_tokens, kwargs, tools=offered, continue_final=continue_final,
                                    add_generation_prompt=add_generation_prompt and not continue_final)
            except Exception as e:      # the template's own refusals (raise_exception) and malformed messages
                raise InvalidInputError(f"the chat template cannot render this chat: {e}") from None

        text = render_with(tools)
        if tools and text == render_with(None):
            raise InvalidInputError("this model's chat template does not render tools: it cannot be offered any")
        if not images:
            return Prompt(self.encode(text), [])
        shown = text.count(pads[0])
        if shown != len(images):
            raise InvalidInputError(f"this model's chat template renders {shown} of the chat's {len(images)} images"
                                    + (" next to tools" if tools else "") + ": it cannot take them in this chat")
        return self._visual_prompt(text, images, (), vision, pads, render)

    @staticmethod
    def _expand(text: str, images: list[VisualInput], videos: list[tuple[VisualInput, int]],
                vision: VisionEncoder | None, image_pad: str, video_pad: str, vs: str, ve: str,
                fps: float | None = None) -> tuple[str, list[VisualInput]]:
        """Replace placeholders in template order, as transformers' Qwen3VLProcessor does."""
        parts = re.split(f"({re.escape(image_pad)}|{re.escape(video_pad)})", text)
        n_img = sum(p == image_pad for p in parts[1::2])
        n_vid = len(parts[1::2]) - n_img
        if (n_img, n_vid) != (len(images), len(videos)):
            raise UnsupportedModelError(
                f"the chat template emitted {n_img} image / {n_vid} video placeholders for "
                f"{len(images)} images / {len(videos)} videos"
            )
        image_iter, video_iter = iter(images), iter(videos)
        out, visuals = [parts[0]], []
        for placeholder, after in zip(parts[1::2], parts[2::2], strict=True):
            if placeholder == image_pad:
                v = next(image_iter)
                out.append(image_pad * v.num_tokens(vision.merge))
            else:
                v, num_frames = next(video_iter)
                t, h, w = v.grid_thw
                per_patch = h * w // vision.merge**2
                # Qwen3-VL: each temporal patch is "<t seconds>" + its own vision_start/end block (nested
                # inside the template's vision_start/end, exactly as transformers' processor writes it).
                stamps = vision.video_timestamps(num_frames, fps) if fps else vision.video_timestamps(num_frames)
                if len(stamps) != t:
                    raise UnsupportedModelError(f"{num_frames} frames, {len(stamps)} timestamps, grid t={t}")
                out.append("".join(f"<{s:.1f} seconds>{vs}{video_pad * per_patch}{ve}" for s in stamps))
            visuals.append(v)
            out.append(after)
        return "".join(out), visuals


def _content(message: Message) -> str | list[dict]:
    # Visuals first, then the text (Qwen's convention); plain string content when there are no visuals
    # so that text-only templates render it too.
    if not (message.images or message.videos):
        return message.text
    content = [{"type": "image"} for _ in message.images] + [{"type": "video"} for _ in message.videos]
    if message.text:
        content.append({"type": "text", "text": message.text})
    return content


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value (keys of objects included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _check_chat(messages: Any, continue_final: bool) -> tuple[list[str], int]:
    """A chat's shape (a list of messages, each an object; a final assistant message to continue); its texts
    (string contents, text parts, the strings of tool calls) and how many image parts it has."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise InvalidInputError("the chat's messages are a non-empty list of objects")
    if continue_final and messages[-1].get("role") != "assistant":
        raise InvalidInputError("continue_final_message needs a final assistant message")
    texts, images = [], 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            texts.append(content)
        texts += _strings(m.get("tool_calls") or [])
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image":
                images += 1
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
    return texts, images


def _find_template(tokenizer, folder: Path) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if template:
        return template
    # Processor-level templates (Qwen-VL checkpoints ship chat_template.json next to the tokenizer).
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template") or None
    return None


def _generation_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
