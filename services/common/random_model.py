"""A random Qwen3.5-architecture checkpoint with a word-level tokenizer and a Qwen chat template.

It stands in for the project's demo model until that ships: answers are noise, but every path (chat
template, images through the vision tower, deferral, timings) is real.
"""

from __future__ import annotations

import json
from pathlib import Path

from raincheck_core.models.random_init import save_random_checkpoint
from raincheck_core.multimodal.chat import chatml_template

# Byte-level BPE without merges: every printable ASCII character is a token ("Ġ" is a space, "Ċ" a newline),
# so any text encodes; the ids left over are whole words, so that sampled noise reads as words.
ALPHABET = [chr(b) for b in range(33, 127)] + ["Ġ", "Ċ"]
WORDS = ["the", "a", "red", "green", "blue", "orange", "yellow", "box", "circle", "square", "left", "right",
         "top", "bottom", "of", "and", "is", "it", "there", "one", "two", "three", "four", "yes", "no", "what",
         "this", "how", "many", "where", "color", "on", "in", "next", "to", "above", "below", "small", "large"]

CHAT_TEMPLATE = chatml_template("you are helpful .")


def save_random_model(folder: str | Path, size: str = "tiny", seed: int = 0, family: str = "qwen3_5") -> Path:
    """Checkpoint + tokenizer in `folder`; every id of the model's vocabulary decodes to some text.
    `family`: any of raincheck_core.models.random_init's (the MoE variants too)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = save_random_checkpoint(folder, family, size, seed)
    config = json.loads((folder / "config.json").read_text())
    vocab_size = config["text_config"]["vocab_size"]
    image = config["image_token_id"]
    specials = {"<|image_pad|>": image, "<|video_pad|>": config["video_token_id"],
                "<|vision_start|>": config["vision_start_token_id"], "<|vision_end|>": config["vision_end_token_id"],
                "<|im_start|>": image + 4, "<|im_end|>": image + 5, "<|endoftext|>": image + 6}
    taken = set(specials.values())
    free = [i for i in range(vocab_size) if i not in taken]
    words = [f"Ġ{w}" for w in WORDS] + [f"Ġw{i}" for i in range(len(free))]
    vocab = dict(zip(["[UNK]", *ALPHABET, *words], free, strict=False))
    tok = Tokenizer(models.BPE(vocab | specials, merges=[], unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    eos = [specials["<|im_end|>"], specials["<|endoftext|>"]]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder
