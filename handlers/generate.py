"""Text generation with SmolLM2-135M-Instruct (bundle `smollm2`).

    {"prompt": "Once upon a time"}                         raw completion
    {"messages": [{"role": "user", "content": "Hi"}]}      chat (ChatML template)
      + "max_tokens" (default 128), "stop" (list of strings),
        "temperature" (default 0 = greedy), "top_p", "top_k", "seed"
    -> {"text", "finish_reason": "stop" | "length",
        "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

A given seed gives the same sampled text every time, whoever else is in the batch.

Concurrent calls share every decode step (continuous batching): the handler is
its `GenerateSteps`, run by the runtime's decode scheduler
(runtime/dispatch/decode.py, docs/generation.md). An empty prompt, or a prompt
and `max_tokens` beyond the context, is a 400.

Streamed (`Accept: text/event-stream`), it yields `{"text": delta}` as tokens
are sampled and a last item `{"text": "", "finish_reason", "usage"}`; a
caller that asked for no stream gets them joined (`join_completion`), the
answer above. It also serves OpenAI's `/v1/chat/completions` and
`/v1/completions` through the same decode steps (docs/openai.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from handlers.models.fields import check_event, get_float, get_int, get_str, get_str_list
from runtime import Context, Decode, InvalidInput, OpenAI, bundle, handler

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from handlers.models.chat import ChatLM, Completion, TextSequence
    from handlers.models.llama import Sampling

DEFAULT_MAX_TOKENS = 128
# Sequences sharing one decode step; later callers wait for a slot, in arrival order.
MAX_SEQUENCES = 16
MAX_TOKENS = 512
# Prompt plus completion; the bundle's KV-cache memory plan is sized for this.
MAX_CONTEXT_TOKENS = 2048
MAX_PROMPT_CHARS = 16_000
MAX_MESSAGES = 32
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_TEMPERATURE = 2.0
ROLES = frozenset({"system", "user", "assistant"})
_FIELDS = frozenset(
    {"prompt", "messages", "max_tokens", "stop", "temperature", "top_p", "top_k", "seed"}
)

# Over two prefill chunks (256 tokens each), so it runs chunked prefill.
_LONG_PROMPT = "Thaw loads a model once and keeps it warm for the requests that follow. " * 40
# On a CPU a first request pays nothing a later one does not: the builder already
# touches every weight, and MKL's float32 GEMM and attention have no per-shape
# set-up. With no warm-up at all, first requests ran at 0.94x (a sampled chat
# request) and 1.03x (a greedy prompt) of steady (BENCHMARKS.md, warmup,
# 2026-12-04), where the one sampled chat example warmed before cost 0.2 s of every
# cold start (issue 29): so a CPU load warms nothing. An accelerator selects (and
# may autotune) kernels on the first call of each shape: there a load warms a
# short prompt, a sampled chat request (tokenizer, chat template, prefill, a decode
# step, the sampler, stop strings), chunked prefill of a long prompt, and 64 decode
# steps that grow the KV cache. The first is `thaw coldstart generate`'s event.
_ACCELERATOR_WARMUP: list[dict[str, Any]] = [
    {"prompt": "The capital of France is", "max_tokens": 4},
    {
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 0,
        "stop": ["\n\n"],
    },
    {"messages": [{"role": "user", "content": _LONG_PROMPT + "Summarise."}], "max_tokens": 4},
    # Counting (top_k 1: sampled, yet deterministic) never stops early, so the KV cache
    # grows for all 64 steps.
    {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 64, "temperature": 0.8, "top_k": 1},
]


@bundle("smollm2")
def build_smollm2(
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    device: str,
    files: Mapping[str, Path],
) -> ChatLM:
    from handlers.models.chat import ChatLM

    if "tokenizer.json" not in files:
        raise ValueError("bundle smollm2 has no tokenizer.json")
    # The weights dict is this builder's own (the runtime keeps no other use of
    # it): emptying it as the model is made keeps the fused copies from raising
    # the load's peak memory by half the weights.
    return ChatLM(config, weights, files["tokenizer.json"], device, consume=True)


def _messages(value: Any) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        raise InvalidInput("messages", "must be a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        raise InvalidInput("messages", f"has {len(value)} items; the limit is {MAX_MESSAGES}")
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise InvalidInput(where, "must be an object with exactly 'role' and 'content'")
        if message["role"] not in ROLES:
            raise InvalidInput(f"{where}.role", f"must be one of {', '.join(sorted(ROLES))}")
        content = get_str(message["content"], f"{where}.content", MAX_PROMPT_CHARS)
        turns.append((message["role"], content))
    if sum(len(content) for _, content in turns) > MAX_PROMPT_CHARS:
        raise InvalidInput("messages", f"hold more than {MAX_PROMPT_CHARS} characters in all")
    return turns


def _stops(value: Any) -> list[str]:
    if value == []:
        return []
    stop = get_str_list(value, "stop", MAX_STOP_STRINGS, MAX_STOP_CHARS)
    if not all(stop):
        raise InvalidInput("stop", "stop strings must not be empty")
    return stop


def _prompt_ids(fields: Mapping[str, Any], lm: ChatLM) -> tuple[str, list[int]]:
    """The field the prompt came from, and its token ids."""
    if ("prompt" in fields) == ("messages" in fields):
        raise InvalidInput("prompt", "give exactly one of 'prompt' or 'messages'")
    if "prompt" in fields:
        return "prompt", lm.encode_prompt(get_str(fields["prompt"], "prompt", MAX_PROMPT_CHARS))
    turns = _messages(fields["messages"])
    try:
        return "messages", lm.encode_chat(turns)
    except ValueError as exc:
        raise InvalidInput("messages", str(exc)) from None


def join_completion(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The streamed items as one answer: the text, and the last item's finish and usage
    (absent while the stream runs: a job's partial output is the text so far)."""
    joined: dict[str, Any] = {"text": "".join(item["text"] for item in items)}
    if items and "finish_reason" in items[-1]:
        joined["finish_reason"] = items[-1]["finish_reason"]
        joined["usage"] = items[-1]["usage"]
    return joined


@dataclass(frozen=True)
class Request:
    """One `generate` event, checked and tokenized."""

    prompt_ids: list[int]
    max_tokens: int
    opts: Sampling
    stop: list[str]


def parse_request(event: Any, lm: ChatLM) -> Request:
    """`event` checked against the model: InvalidInput (400) names what is wrong."""
    from handlers.models.llama import Sampling

    fields = check_event(event, _FIELDS)
    max_tokens = get_int(fields, "max_tokens", DEFAULT_MAX_TOKENS, 1, MAX_TOKENS)
    stop = _stops(fields.get("stop", []))
    opts = Sampling(
        temperature=get_float(fields, "temperature", 0.0, 0.0, MAX_TEMPERATURE),
        top_k=get_int(fields, "top_k", 0, 0, lm.vocab_size),
        top_p=get_float(fields, "top_p", 1.0, 0.0, 1.0),
        seed=get_int(fields, "seed", 0, 0, 2**63 - 1) if "seed" in fields else None,
    )
    if opts.top_p <= 0.0:
        raise InvalidInput("top_p", "must be above 0")
    source, prompt_ids = _prompt_ids(fields, lm)  # tokenizes: checked last
    if not prompt_ids:
        raise InvalidInput(source, "is empty: there is nothing to complete")
    context = min(MAX_CONTEXT_TOKENS, lm.max_context_tokens)
    if len(prompt_ids) + max_tokens > context:
        raise InvalidInput(
            source,
            f"prompt is {len(prompt_ids)} tokens; with max_tokens {max_tokens} it exceeds "
            f"the {context}-token context",
        )
    return Request(prompt_ids, max_tokens, opts, stop)


def _item(piece: str | Completion) -> dict[str, Any]:
    if isinstance(piece, str):
        return {"text": piece}
    return {
        "text": "",
        "finish_reason": piece.finish_reason,
        "usage": {
            "prompt_tokens": piece.prompt_tokens,
            "completion_tokens": piece.completion_tokens,
            "total_tokens": piece.prompt_tokens + piece.completion_tokens,
        },
    }


class GenerateSteps:
    """`generate` as decode steps (runtime.Steps): concurrent callers share every
    forward pass of the model (runtime/dispatch/decode.py), each with its own KV
    cache, sampler and stop conditions."""

    def __init__(self, lm: ChatLM) -> None:
        self.lm = lm

    def prefill(self, events: list[Any], ctxs: list[Context]) -> list[Any]:
        started: list[Any] = []
        for event in events:
            try:
                r = parse_request(event, self.lm)
                sequence = self.lm.begin(r.prompt_ids, r.max_tokens, r.opts, r.stop)
                self.lm.run_prompt(sequence)  # beside the others' steps (decode.py)
                started.append(sequence)
            except Exception as exc:  # this caller's alone (InvalidInput: 400)
                started.append(exc)
        return started

    def step(self, sequences: list[TextSequence]) -> list[Any]:
        return [[_item(p) for p in pieces] for pieces in self.lm.advance(sequences)]

    def finished(self, sequence: TextSequence) -> bool:
        return sequence.finished

    def release(self, sequence: TextSequence) -> None:
        sequence.release()


@handler(
    "generate",
    uses=["smollm2"],
    accelerator_warmup=_ACCELERATOR_WARMUP,
    join=join_completion,
    decode=Decode(max_sequences=MAX_SEQUENCES),
    openai=OpenAI("chat", "completions", aliases=["smollm2", "SmolLM2-135M-Instruct"]),
)
def generate(smollm2: ChatLM) -> GenerateSteps:
    """Complete a prompt or a chat; greedy by default, seeded sampling on request."""
    return GenerateSteps(smollm2)
