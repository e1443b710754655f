"""Text in, text out around a `Llama`: tokenizer, ChatML prompts, stop strings.

Chat prompts are assembled token by token in the ChatML layout the GGUF chat
template describes, rather than by rendering the Jinja template: no template
engine is needed, and message text is encoded with special tokens disabled,
so a user cannot forge `<|im_start|>` turns.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from handlers.models.llama import KVCache, Llama, LlamaConfig, Sampling, generate_steps, sample

# Prompt tokens one batched step runs beside the decode rows: each step then costs
# at most a chunk this size more than a decode step (bench/generation.py).
PREFILL_TOKENS_PER_STEP = 128
# What the oldest prompt runs in a step whose budget shorter prompts took.
MIN_PREFILL_CHUNK = 32


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (stop token or string) or "length"


class ChatLM:
    def __init__(
        self,
        config: Mapping[str, Any],
        weights: Mapping[str, torch.Tensor],
        tokenizer_path: Path,
        device: str,
        *,
        consume: bool = False,
    ) -> None:
        # `consume`: take the tensors out of `weights` as they are used (Llama).
        self.model = Llama(LlamaConfig.from_config(config), weights, device, consume=consume)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        # Text never turns into control tokens; those are added by id only.
        self.tokenizer.encode_special_tokens = True
        stop_ids = config.get("stop_token_ids", [config["eos_token_id"]])
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.chat_format: str | None = config.get("chat_format")
        self.default_system_prompt: str | None = config.get("default_system_prompt")
        self._im_start = self.tokenizer.token_to_id("<|im_start|>")
        self._im_end = self.tokenizer.token_to_id("<|im_end|>")

    @property
    def max_context_tokens(self) -> int:
        return self.model.cfg.max_context_tokens

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        return self._encode(text)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """(role, content) pairs as a ChatML prompt ending in the assistant's turn."""
        if self.chat_format != "chatml" or self._im_start is None or self._im_end is None:
            raise ValueError("this model has no ChatML chat template")
        turns = list(messages)
        if self.default_system_prompt and (not turns or turns[0][0] != "system"):
            turns.insert(0, ("system", self.default_system_prompt))
        ids: list[int] = []
        for role, content in turns:
            ids += [self._im_start, *self._encode(f"{role}\n{content}"), self._im_end]
            ids += self._encode("\n")
        return [*ids, self._im_start, *self._encode("assistant\n")]

    def complete(
        self, prompt_ids: Sequence[int], max_tokens: int, opts: Sampling, stop: Sequence[str]
    ) -> Completion:
        for piece in self.stream(prompt_ids, max_tokens, opts, stop):
            if isinstance(piece, Completion):
                return piece
        raise AssertionError("stream() ends with its Completion")

    def stream(
        self, prompt_ids: Sequence[int], max_tokens: int, opts: Sampling, stop: Sequence[str]
    ) -> Iterator[str | Completion]:
        """The completion's text in pieces as tokens are sampled, then its `Completion`,
        from a private decode loop (`generate_steps`): the per-request path that
        `begin`/`advance` batch. The pieces join to exactly the Completion's text
        (see `TextPieces`)."""
        pieces = TextPieces(self.tokenizer, stop)
        steps = generate_steps(
            self.model, prompt_ids, max_tokens, opts, self.stop_ids, pieces.hit_stop
        )
        while True:
            try:
                token = next(steps)
            except StopIteration as end:
                stopped: bool = end.value
                break
            if (piece := pieces.add(token)) is not None:
                yield piece
        yield from pieces.end(len(prompt_ids), stopped)

    # ---- one sequence among many (continuous batching: handlers/generate.py) --------

    def begin(
        self, prompt_ids: Sequence[int], max_tokens: int, opts: Sampling, stop: Sequence[str]
    ) -> TextSequence:
        """A sequence with its own KV cache; its prompt is run by the steps that follow."""
        return TextSequence(self, prompt_ids, max_tokens, opts, stop)

    def run_prompt(self, sequence: TextSequence) -> None:
        """Its whole prompt into its cache (`Llama.prefill`, as the per-request loop
        runs it): its next step samples its first token and runs no forward pass."""
        if sequence.cache is None:
            raise ValueError("a released sequence cannot take another step")
        device = self.model.embed.device
        ids = torch.tensor(sequence.pending, dtype=torch.long, device=device)
        sequence.logits = self.model.prefill(ids, sequence.cache)
        sequence.pending = []

    def advance(self, sequences: Sequence[TextSequence]) -> list[list[str | Completion]]:
        """One step of each sequence: the pieces each yields now.

        The step is one forward pass (`Llama.run`) of every sequence's last sampled
        token and of prompt chunks of the sequences not yet prefilled, at most
        `PREFILL_TOKENS_PER_STEP` prompt tokens, shortest prompts first (so a short
        prompt does not wait behind a long one; the oldest always gets a chunk, so
        none waits forever). A sequence whose prompt is done samples its first
        token in that step. Each sequence samples with its own generator, so a seed
        gives the same tokens whoever else is in the step. A lone sequence runs as
        the per-request loop does: its whole prompt (`Llama.prefill`), then one
        token a step.
        """
        if any(s.cache is None for s in sequences):
            raise ValueError("a released sequence cannot take another step")
        prompts = [s for s in sequences if s.pending]
        if len(sequences) == 1 and prompts:
            self.run_prompt(prompts[0])
        else:
            self._run([s for s in sequences if s.logits is None and not s.pending], prompts)
        return [
            s.take(sample(s.logits, s.opts, s.generator)) if s.logits is not None else []
            for s in sequences
        ]

    def _run(self, decoding: list[TextSequence], prompts: list[TextSequence]) -> None:
        budget = PREFILL_TOKENS_PER_STEP
        chunks: dict[int, int] = {}
        for s in sorted(prompts, key=lambda s: len(s.pending)):
            if budget <= 0:
                break
            chunks[id(s)] = take = min(len(s.pending), budget)
            budget -= take
        if prompts and id(prompts[0]) not in chunks:
            chunks[id(prompts[0])] = min(len(prompts[0].pending), MIN_PREFILL_CHUNK)
        chunked = [s for s in prompts if id(s) in chunks]
        pieces = [([s.ids[-1]], s.cache) for s in decoding]
        pieces += [(s.pending[: chunks[id(s)]], s.cache) for s in chunked]
        if not pieces:
            return
        rows = self.model.run(pieces)  # type: ignore[arg-type]
        for sequence, row in zip(decoding + chunked, rows, strict=True):
            if sequence.pending:
                sequence.pending = sequence.pending[chunks[id(sequence)] :]
                if sequence.pending:
                    continue  # mid-prompt: its row's logits are not a next token
            sequence.logits = row


class TextPieces:
    """Token ids to text pieces for one completion, with its stop strings.

    A piece is held back while it could still change: a trailing U+FFFD is half
    a UTF-8 character whose next bytes are in the next token, and the last
    `longest stop - 1` characters could begin a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def hit_stop(self, ids: list[int]) -> bool:
        if not self.stop:
            return False
        text = self.tokenizer.decode(ids)
        return any(s in text for s in self.stop)

    def add(self, token: int) -> str | None:
        """Take one sampled token: the text that is now safe to send, if any."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        safe = len(text.rstrip("\ufffd")) - self.hold
        if safe > self.sent and not any(s in text for s in self.stop):
            piece = text[self.sent : safe]
            self.sent = safe
            return piece
        return None

    def end(self, prompt_tokens: int, stopped: bool) -> Iterator[str | Completion]:
        """The rest of the text (cut at the first stop string), then the Completion."""
        text = self.tokenizer.decode(self.ids)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=len(text))
        if cut > self.sent:
            yield text[self.sent : cut]
        yield Completion(
            text=text[:cut],
            prompt_tokens=prompt_tokens,
            completion_tokens=len(self.ids),
            finish_reason="stop" if stopped else "length",
        )


class TextSequence:
    """One caller's completion as steps: its cache, sampler, text and stop conditions
    (the stop tokens, its stop strings, `max_tokens`), exactly as `generate_steps`
    and `ChatLM.stream` apply them."""

    def __init__(
        self,
        lm: ChatLM,
        prompt_ids: Sequence[int],
        max_tokens: int,
        opts: Sampling,
        stop: Sequence[str],
    ) -> None:
        self.prompt_tokens = len(prompt_ids)
        self.max_tokens = max_tokens
        self.opts = opts
        self.stop_ids = lm.stop_ids
        self.generator: torch.Generator | None = None
        if opts.temperature > 0:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(opts.seed if opts.seed is not None else torch.seed())
        self.cache: KVCache | None = lm.model.new_cache(len(prompt_ids) + max_tokens)
        # Prompt tokens not yet run into the cache (`ChatLM.advance` runs them).
        self.pending: list[int] = list(prompt_ids)
        self.logits: torch.Tensor | None = None
        self.pieces = TextPieces(lm.tokenizer, stop)
        self.finished = False

    @property
    def ids(self) -> list[int]:
        return self.pieces.ids

    def take(self, token: int) -> list[str | Completion]:
        """One sampled token: the pieces it makes (and, at the end, the Completion)."""
        self.logits = None
        pieces = self.pieces
        stopped = token in self.stop_ids
        out: list[str | Completion] = []
        if not stopped:
            if (piece := pieces.add(token)) is not None:
                out.append(piece)
            stopped = pieces.hit_stop(pieces.ids)
        if stopped or len(pieces.ids) == self.max_tokens:
            self.finished = True
            out += pieces.end(self.prompt_tokens, stopped)
        return out

    def release(self) -> None:
        """Its KV cache freed (the sequence takes no more steps)."""
        self.cache = None
        self.pending = []
        self.logits = None
