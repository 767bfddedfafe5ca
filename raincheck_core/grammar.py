"""Constrained decoding: a turn's answer held to a grammar (a JSON schema, a regex, a choice, a Lark grammar)
by masking, in its own row of each step, the tokens the grammar cannot take next.

The grammar library is llguidance (CPU, Rust): it was picked over outlines-core by the per-turn cost a
server pays (bench/grammar_mask.py measures both on the batched sampler). A grammar arrives as
llguidance's grammar text (`grammar_from`, `json_schema_grammar` build it); one that is invalid is an
`InvalidInputError` before the turn runs, and so is one the checkpoint's vocabulary cannot write
(`GrammarError`, naming what it cannot write).

**The mask is the parser's own.** llguidance computes each mask from its parser, with one shortcut: where
the grammar forces bytes (`{"name":"` at the start of an object), it tokenizes them with the tokenizer it
was given and allows only the first of those tokens, trusting that they spell the forced bytes. Given the
Hugging Face tokenizer of a vocabulary that lacks a forced byte, they did not: the demo models have no braces
or quotes, so `{"name":"` came back as `n`,`a`,`m`,`e`, the mask allowed `n`, and the parser refused it once
drawn (an HTTP 500 with the parser's state). Now:
- a vocabulary that can write every byte (byte-level BPE: the Qwen family) keeps the shortcut, with a
  tokenize function that is exact (`Vocabulary.tokenize`: the Hugging Face tokens when they spell the text,
  else the longest-match tokens, which always do; a normalizer could otherwise respell it);
- any other vocabulary gets no shortcut (llguidance's `no_forcing`, `Grammars.for_vocabulary`): every mask
  is computed by the parser from the bytes each token spells.
Either way every token the sampler can draw is one the parser takes (tests/engine/test_grammar.py walks
random paths through the mask to check it).

**What cannot be written is refused up front.** A turn's constraint looks for one complete answer before the
turn runs (`TokenConstraint.check`, a bounded search from the first mask); where every path dies it is a
`GrammarError` saying what the vocabulary cannot write, e.g. `'{'` where the answer must begin `{"name":"`.
Where the search cannot decide (large schemas), the turn runs, and a dead end met while answering ends that
turn with a `GrammarError` saying the same, as an error of the turn (never a server fault).
"""

from __future__ import annotations

import bisect
import importlib
import json
from copy import copy
from typing import TYPE_CHECKING

import torch

from .errors import GrammarError, InvalidInputError

# how a refusal up front begins (`GrammarMatcher.check`): the HTTP frontend names its request's field before it
UNWRITABLE = "the model's vocabulary cannot write any answer this grammar accepts"

if TYPE_CHECKING:
    import llguidance

SEARCH_MASKS = 256        # masks the up-front search may compute before it gives up (undecided: the turn runs)
SEARCH_BRANCHES = 8       # a state with more allowed tokens than this is not searched exhaustively
LOOKAHEAD_MASKS = 32      # masks a decode step's look past its few allowed tokens may compute (TokenConstraint)
NO_FORCING = '%llguidance {"no_forcing": true}\n'
UTF8_BYTES = [*range(0xc0), *range(0xc2, 0xf5)]
TOKENIZED_KEPT = 4096     # forced texts whose exact tokens a vocabulary keeps
SHOWN_BYTES = 48          # of forced text and of the answer so far, in messages


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


def grammar_from(kind: str, text: str | list[str] | dict | bool) -> str:
    """llguidance's grammar text of a `json` schema (`json_schema_grammar`), a `regex`, a `choice` (a list of
    strings), or a `grammar` (Lark, or GBNF / EBNF as llama.cpp writes it). ValueError for what cannot be one."""
    llg = _llguidance()
    if kind == "json":
        return json_schema_grammar(text)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark(choice_lark(text))
    return llg.grammar_from(kind, text)


def choice_lark(choices: list[str]) -> str:
    """A Lark rule body for exactly one of `choices` (strings written as JSON literals, which Lark reads)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _shown(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace")
    return repr(text if len(text) <= SHOWN_BYTES else text[:SHOWN_BYTES] + "…")


class Vocabulary:
    """The checkpoint's tokens as the bytes each spells (llguidance's reading of the tokenizer), whether they
    can write every byte, and the tokenize function llguidance is given: always exact (see the module's
    docstring)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_id: int):
        llg = _llguidance()
        probe = llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=stop_id)
        self.size = probe.vocab_size
        self.special = [i for i in range(self.size) if probe.is_special_token(i)]
        self.tokens = [probe.decode_bytes([i]) for i in range(self.size)]
        # what each token spells in the parser's bytes: special tokens are marked, so they never spell text
        self.spelled = list(self.tokens)
        for i in self.special:
            self.spelled[i] = b"\xff" + self.tokens[i]
        special = set(self.special)
        self._sorted = sorted(t for i, t in enumerate(self.tokens) if t and i not in special)
        self._exact = set(self._sorted)
        self._longest = max((len(t) for t in self._sorted), default=0)
        # every byte UTF-8 text can hold is a token: any forced text can be written, so llguidance may force
        # tokens (0xff is llguidance's mark of a special token, and no UTF-8 byte)
        self.byte_complete = all(bytes([b]) in self._exact for b in UTF8_BYTES)
        self._probe = probe
        backend = copy(hf_tokenizer.backend_tokenizer)      # its own copy: no padding or truncation state shared
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self._tokenized: dict[bytes, tuple[int, ...]] = {}
        # the up-front search's order among many allowed tokens: those that close something (an answer ends
        # sooner), then shorter ones
        self.search_rank = torch.tensor([len(t) + (0 if t[-1:] in (b'"', b"}", b"]") else 1 << 16)
                                         for t in self.tokens], dtype=torch.int32)

    def tokenize(self, text: str | bytes) -> list[int]:
        """Tokens that spell exactly `text`: the Hugging Face tokenizer's when they do (a vocabulary without one
        of its bytes, or a normalizer, gives tokens that spell something else), else the longest-match ones
        (which do wherever the vocabulary can write every byte, the only case llguidance calls this in)."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = self._tokenized.get(data)
        if ids is None:
            if len(self._tokenized) >= TOKENIZED_KEPT:      # forced texts repeat (keys, punctuation): keep some
                self._tokenized.clear()
            ids = self._tokenized[data] = self._exact_tokens(data)
        return list(ids)

    def _exact_tokens(self, data: bytes) -> tuple[int, ...]:
        try:
            ids = self._backend.encode(data.decode("utf-8"), add_special_tokens=False).ids
        except Exception:      # not UTF-8, or the tokenizer's own failure: the longest-match tokens below
            ids = []
        if ids and all(i < self.size for i in ids) and b"".join(self.spelled[i] for i in ids) == data:
            return tuple(ids)
        return tuple(self._probe.greedy_tokenize(data.decode("utf-8", errors="replace")))

    def llg_tokenizer(self, stop_id: int) -> llguidance.LLTokenizer:
        """llguidance's tokenizer over these tokens, `stop_id` ending an answer, tokenizing by `tokenize`."""
        llg = _llguidance()
        return llg.LLTokenizer(llg.TokenizerWrapper(_Spec(self, stop_id)), n_vocab=self.size, eos_token=stop_id)

    def _starts_with(self, prefix: bytes) -> bool:
        """Some token spells `prefix` and more (or exactly it)."""
        i = bisect.bisect_left(self._sorted, prefix)
        return i < len(self._sorted) and self._sorted[i].startswith(prefix)

    def unwritable(self, forced: bytes) -> tuple[int, bytes] | None:
        """Where the vocabulary cannot write `forced` (text the grammar requires next): the offset of the
        first byte no sequence of tokens reaches past, and that character; None when it can write it."""
        reach, furthest = {0}, 0
        for p in range(len(forced) + 1):
            if p not in reach:
                continue
            furthest = p
            if p == len(forced) or self._starts_with(forced[p:]):
                return None          # written to its end (a token may run past it)
            for n in range(1, min(self._longest, len(forced) - p) + 1):
                if forced[p:p + n] in self._exact:
                    reach.add(p + n)
        char = forced[furthest:furthest + 4].decode("utf-8", errors="ignore")[:1].encode("utf-8")
        return furthest, char or forced[furthest:furthest + 1]


class _Spec:
    """What llguidance's `TokenizerWrapper` reads: token bytes, specials, the stop token, and a tokenize call."""

    def __init__(self, vocab: Vocabulary, stop_id: int):
        self.tokens = vocab.tokens
        self.special_token_ids = vocab.special
        self.eos_token_id = stop_id
        self.bos_token_id = None
        self._tokenize = vocab.tokenize

    def __call__(self, text: str | bytes) -> list[int]:
        return self._tokenize(text)


class Grammars:
    """The checkpoint's tokenizer as llguidance sees it, once per stop token (building one takes about a
    second, so it is built on first use and kept); turns' constraints are compiled against it."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.vocabulary: Vocabulary | None = None
        self._tokenizers: dict[int, llguidance.LLTokenizer] = {}

    def constraint(self, grammar: str, stop_id: int, check: bool = True) -> TokenConstraint:
        """`grammar`'s constraint for an answer that `stop_id` ends: InvalidInputError if it is invalid,
        GrammarError (with `check`) if the vocabulary cannot write any answer it accepts."""
        if self.hf_tokenizer is None:
            raise InvalidInputError("this checkpoint has no tokenizer: grammars need one")
        llg = _llguidance()
        tokenizer = self._tokenizers.get(stop_id)
        if tokenizer is None:
            if self.vocabulary is None:
                self.vocabulary = Vocabulary(self.hf_tokenizer, self.vocab_size, stop_id)
            tokenizer = self._tokenizers[stop_id] = self.vocabulary.llg_tokenizer(stop_id)
        grammar = self.for_vocabulary(grammar)
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidInputError(f"invalid grammar: {error}")
        constraint = TokenConstraint(llg.LLMatcher(tokenizer, grammar, log_level=0), self.vocab_size,
                                     self.vocabulary, stop_id)
        if check:
            constraint.check()
        return constraint

    def for_vocabulary(self, grammar: str) -> str:
        """`grammar` as this vocabulary runs it: as it is where the vocabulary can write every byte, else with
        llguidance's forcing off (each JSON-schema part as Lark's `%json`, as only Lark carries the option)."""
        if self.vocabulary is None or self.vocabulary.byte_complete:
            return grammar
        try:
            top = json.loads(grammar)
        except json.JSONDecodeError:
            top = None
        if not (isinstance(top, dict) and isinstance(top.get("grammars"), list)):
            return NO_FORCING + grammar                # Lark text itself
        for part in top["grammars"]:
            if not isinstance(part, dict):
                continue
            if part.get("json_schema") is not None:
                part["lark_grammar"] = f"{NO_FORCING}start: %json {json.dumps(part.pop('json_schema'))}"
            elif isinstance(part.get("lark_grammar"), str):
                part["lark_grammar"] = NO_FORCING + part["lark_grammar"]
        return json.dumps(top)


_BITS = torch.arange(32, dtype=torch.int32)


def _mask(matcher: llguidance.LLMatcher, vocab_size: int) -> torch.Tensor:
    """`[vocab]` bool: the tokens `matcher` can take next (llguidance's bitmask, one bit a token)."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    return ((words.unsqueeze(1) >> _BITS) & 1).bool().flatten()[:vocab_size]


class TokenConstraint:
    """One turn's grammar state: which tokens may come next, advanced by each drawn token.

    Where the vocabulary cannot write every byte, a token the parser takes may lead only to text the
    vocabulary cannot write (`x` of a choice between `blue` and `x{y`, on a vocabulary without `{`). So in
    such a vocabulary, where few tokens are allowed (at most SEARCH_BRANCHES), each is kept only unless a
    short search proves every way on from it dead (`LOOKAHEAD_MASKS` masks a step at most): the sampler does
    not walk into a dead end it could have seen. What is left is still a subset of the parser's mask."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, vocabulary: Vocabulary, stop_id: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.vocabulary = vocabulary
        self.stop_id = stop_id
        self.initial = matcher.deep_copy()       # to replay the answer on, for a dead end's message
        self.consumed: list[int] = []
        self.written = b""          # the answer so far, in bytes (for messages)

    def allowed(self) -> torch.Tensor:
        """`[vocab]` bool: the tokens the grammar can take next. GrammarError at a dead end: no token allowed,
        because the vocabulary cannot write what the grammar requires next."""
        mask = _mask(self.matcher, self.vocab_size)
        if self.matcher.is_error() or not mask.any():
            replay = self.initial.deep_copy()
            replay.consume_tokens(self.consumed)
            raise GrammarError(self._dead_end(replay.compute_ff_bytes(), self.written))
        if not self.vocabulary.byte_complete and 1 < int(mask.sum()) <= SEARCH_BRANCHES:
            mask = self._prune(mask)
        return mask

    def _prune(self, mask: torch.Tensor) -> torch.Tensor:
        budget, reasons = [LOOKAHEAD_MASKS], []
        for token in mask.nonzero().flatten().tolist():
            if token == self.stop_id:
                continue
            child = self.matcher.deep_copy()
            child.consume_token(token)
            found, reason = self._search(child, self.written + self.vocabulary.tokens[token], budget,
                                         refusing=not self.consumed)
            if found is False:
                mask[token] = False
                reasons.append(reason)
        if not mask.any():
            raise GrammarError(reasons[0])
        return mask

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits [vocab]` with the tokens the grammar cannot take next at -inf (in place)."""
        return logits.masked_fill_(~self.allowed().to(logits.device), float("-inf"))

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)
        if self.matcher.is_error():     # the mask allowed it, so this is not the model's choice: say so briefly
            raise GrammarError(f"the grammar refused token {token} after {_shown(self.written)}: "
                               f"{self.matcher.get_error().splitlines()[0][:200]}")
        self.consumed.append(token)
        if token != self.stop_id and token < self.vocabulary.size:
            self.written = (self.written + self.vocabulary.tokens[token])[-SHOWN_BYTES:]

    def _dead_end(self, forced: bytes | None, written: bytes, refusing: bool = False) -> str:
        """What the vocabulary cannot write where an answer that has written `written` cannot go on (`refusing`:
        on every way from the start, found before the turn runs)."""
        head = (f"{UNWRITABLE}: " if refusing else
                "the model's vocabulary cannot finish this answer: ")
        at = f"after {_shown(written[-SHOWN_BYTES:])}" if written else "at the start"
        where = self.vocabulary.unwritable(forced) if forced else None
        if where is None:
            return head + f"{at} no token of the vocabulary can come next"
        offset, char = where
        return (head + f"{at} the grammar requires {_shown(forced)}, and no token writes {_shown(char)}"
                + (f" (after {_shown(forced[:offset])} of it)" if offset else ""))

    def check(self) -> None:
        """GrammarError if no answer the grammar accepts can be written by the vocabulary: a bounded search
        for one complete answer, from this (the first) state. A state with few allowed tokens is searched
        through all of them, a larger one through its likeliest ways to an end (closing quotes and brackets
        first); the search proves a dead end only where it tried every allowed token, and otherwise (or out
        of budget) lets the turn run. A vocabulary that writes every byte can write whatever the grammar
        requires: its first mask is all there is to check."""
        budget = 1 if self.vocabulary.byte_complete else SEARCH_MASKS
        found, reason = self._search(self.matcher.deep_copy(), b"", [budget], refusing=True)
        if found is False:
            raise GrammarError(reason)

    def _search(self, matcher, written: bytes, budget: list[int], refusing: bool) -> tuple[bool | None, str]:
        """From `matcher`'s state (the answer has written `written`): (True, "") when an end is reachable,
        (False, why) when every way on dies, (None, "") undecided. `budget`: masks left to compute."""
        if budget[0] <= 0:
            return None, ""
        budget[0] -= 1
        forced = matcher.deep_copy().compute_ff_bytes()
        mask = _mask(matcher, self.vocab_size)
        if matcher.is_error() or not mask.any():
            if matcher.stop_reason() in ("ParserTooComplex", "LexerTooComplex", "MaxTokensTotal", "MaxTokensParser"):
                return None, ""      # a limit of the library, not a dead end
            return False, self._dead_end(forced, written, refusing)
        if self.stop_id < mask.numel() and mask[self.stop_id]:
            return True, ""
        allowed = mask.nonzero().flatten()
        exhaustive = len(allowed) <= SEARCH_BRANCHES
        rank = self.vocabulary.search_rank[allowed]
        allowed = allowed[rank.topk(min(len(allowed), SEARCH_BRANCHES // 2 if not exhaustive else len(allowed)),
                                    largest=False, sorted=True).indices].tolist()
        first_reason = ""
        for token in allowed:
            child = matcher.deep_copy()
            child.consume_token(token)
            found, reason = (None, "") if child.is_error() else \
                self._search(child, (written + self.vocabulary.tokens[token])[-SHOWN_BYTES:], budget, refusing)
            if found:
                return True, ""
            if found is None:
                exhaustive = False
            first_reason = first_reason or reason
        return (False, first_reason) if exhaustive else (None, "")
