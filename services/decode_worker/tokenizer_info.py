"""The checkpoint's tokenizer as a client would load it (vLLM's `/tokenizer_info`, which lm-eval and SGLang
read instead of a local tokenizer path): its settings from tokenizer_config.json, special tokens, sizes,
stop tokens and the chat template the worker renders with."""

from __future__ import annotations

import json
from typing import Any

from raincheck_client._gen import chat_pb2
from raincheck_core import Engine, InvalidInputError
from raincheck_core.multimodal.chat import chatml_template

# settings that name places on the worker's disk, or how it loaded the files: not the client's business
_LOCAL = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only",
          "cache_dir", "backend")


def tokenizer_info(engine: Engine) -> chat_pb2.TokenizerInfoResponse:
    formatter = engine.formatter
    if formatter is None:
        raise InvalidInputError("this checkpoint has no tokenizer")
    tokenizer = formatter.tokenizer
    info = {k: _plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _LOCAL}
    limit = engine.max_model_len
    info |= {
        "tokenizer_class": type(tokenizer).__name__,
        "chat_template": formatter.chat_template or chatml_template(),
        "vocab_size": engine.model_config.vocab_size,        # the model's rows (ids below it are valid)
        "tokenizer_vocab_size": len(tokenizer),
        "model_max_length": limit if limit is not None else info.get("model_max_length"),
        "max_model_len": limit,
        "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
        "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "special_tokens": list(tokenizer.all_special_tokens),
        "added_tokens": {str(i): t.content for i, t in sorted(tokenizer.added_tokens_decoder.items())},
        "stop_token_ids": list(formatter.stop_token_ids),
        "turn_end_token": formatter.turn_end,
    }
    info.pop("added_tokens_decoder", None)
    return chat_pb2.TokenizerInfoResponse(info_json=json.dumps(info))


def _plain(value: Any) -> Any:
    """A setting as JSON: AddedToken as its text, numbers past JSON's range (transformers' "no limit") as None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**53 else None
    if isinstance(value, float):
        return value
    return getattr(value, "content", None) or str(value)
