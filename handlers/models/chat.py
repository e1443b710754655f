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

from handlers.models.llama import Llama, LlamaConfig, Sampling, generate_steps


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
    ) -> None:
        self.model = Llama(LlamaConfig.from_config(config), weights, device)
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
        """The completion's text in pieces as tokens are sampled, then its `Completion`.

        The pieces join to exactly the Completion's text. A piece is held back
        while it could still change: a trailing U+FFFD is half a UTF-8
        character whose next bytes are in the next token, and the last
        `longest stop - 1` characters could begin a stop string.
        """

        def hit_stop(ids: list[int]) -> bool:
            text = self.tokenizer.decode(ids)
            return any(s in text for s in stop)

        hold = max((len(s) for s in stop), default=1) - 1
        steps = generate_steps(
            self.model, prompt_ids, max_tokens, opts, self.stop_ids, hit_stop if stop else _never
        )
        ids: list[int] = []
        sent = 0
        while True:
            try:
                ids.append(next(steps))
            except StopIteration as end:
                stopped: bool = end.value
                break
            text = self.tokenizer.decode(ids)
            safe = len(text.rstrip("\ufffd")) - hold
            if safe > sent and not any(s in text for s in stop):
                yield text[sent:safe]
                sent = safe
        text = self.tokenizer.decode(ids)
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
        if cut > sent:
            yield text[sent:cut]
        yield Completion(
            text=text[:cut],
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(ids),
            finish_reason="stop" if stopped else "length",
        )


def _never(_ids: list[int]) -> bool:
    return False
