"""The demo model's word-level tokenizer: the world's words plus Qwen's special tokens, with Qwen ChatML.

Special tokens come last, so the config's image/video/vision-start/end ids are fixed by `SPECIALS`.
Whitespace (including the template's newlines) separates words and is not a token.
"""

from __future__ import annotations

from pathlib import Path

from .world import vocabulary

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>")
WORDS = ("[UNK]", "system", "user", "assistant", *vocabulary())
VOCAB = {w: i for i, w in enumerate((*WORDS, *SPECIALS))}
VOCAB_SIZE = len(VOCAB)
PAD, IM_START, IM_END = VOCAB["<|endoftext|>"], VOCAB["<|im_start|>"], VOCAB["<|im_end|>"]
VISION_START, VISION_END = VOCAB["<|vision_start|>"], VOCAB["<|vision_end|>"]
IMAGE_PAD, VIDEO_PAD = VOCAB["<|image_pad|>"], VOCAB["<|video_pad|>"]

# Qwen ChatML (as Qwen2-VL/Qwen3-VL render it) without a default system prompt; visuals as typed parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for c in message.content %}"
    "{%- if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif c.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif c.type == 'text' %}{{ c.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer():
    """A transformers fast tokenizer (WordLevel, whitespace/punctuation split) with the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(dict(VOCAB), unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with single spaces
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(folder: Path) -> None:
    build_tokenizer().save_pretrained(folder)
