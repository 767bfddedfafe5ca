"""Constrained decoding: a turn's answer held to a grammar (a JSON schema, a Lark grammar) by masking, in
its own row of each step, the tokens the grammar cannot take next.

The grammar library is llguidance (CPU, Rust): it was picked over outlines-core by the per-turn cost a
server pays (bench/grammar_mask.py measures both on the batched sampler). A grammar arrives as
llguidance's grammar text (`LLMatcher.grammar_from_json_schema` / `grammar_from_lark` build it); one
that is invalid, or that the checkpoint's vocabulary cannot even start, is an `InvalidInputError`.
"""

from __future__ import annotations

import importlib
import json
from typing import TYPE_CHECKING

import torch

from .errors import InvalidInputError, SamplingError

if TYPE_CHECKING:
    import llguidance


def _llguidance():
    """The llguidance module (with its `hf` tokenizer bridge), imported on first use."""
    importlib.import_module("llguidance.hf")
    return importlib.import_module("llguidance")


def json_schema_grammar(schema: dict | bool) -> str:
    """The grammar of JSON values `schema` accepts, written compactly (no free whitespace: a model could
    otherwise pad an answer with whitespace for ever) unless the schema's `x-guidance` says otherwise."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}
    return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema))


class Grammars:
    """The checkpoint's tokenizer as llguidance sees it, once per stop token (building one takes about a
    second, so it is built on first use and kept); turns' constraints are compiled against it."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._tokenizers: dict[int, llguidance.LLTokenizer] = {}

    def constraint(self, grammar: str, stop_id: int) -> TokenConstraint:
        """`grammar`'s constraint for an answer that `stop_id` ends (InvalidInputError if it is invalid)."""
        if self.hf_tokenizer is None:
            raise InvalidInputError("this checkpoint has no tokenizer: grammars need one")
        llg = _llguidance()
        tokenizer = self._tokenizers.get(stop_id)
        if tokenizer is None:
            tokenizer = self._tokenizers[stop_id] = llg.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=stop_id)
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidInputError(f"invalid grammar: {error}")
        return TokenConstraint(llg.LLMatcher(tokenizer, grammar), self.vocab_size)


_BITS = torch.arange(32, dtype=torch.int32)


class TokenConstraint:
    """One turn's grammar state: which tokens may come next, advanced by each drawn token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        first = self.allowed()       # computing the first mask is what finds a dead start
        if matcher.is_error() or not first.any():
            error = matcher.get_error().splitlines()[0] if matcher.is_error() else "no token allowed"
            raise InvalidInputError(f"the model's vocabulary cannot start an answer this grammar accepts ({error})")

    def allowed(self) -> torch.Tensor:
        """`[vocab]` bool: the tokens the grammar can take next (llguidance's bitmask, one bit a token)."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        return ((words.unsqueeze(1) >> _BITS) & 1).bool().flatten()[:self.vocab_size]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits [vocab]` with the tokens the grammar cannot take next at -inf (in place)."""
        return logits.masked_fill_(~self.allowed().to(logits.device), float("-inf"))

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)
        if self.matcher.is_error():
            raise SamplingError(f"the grammar refused token {token}: {self.matcher.get_error()}")
