"""Handlers that declare OpenAI operations over a model-free bundle, named by behaviour.

Bundle `lexicon` (any weights): its builder sleeps `config["sleep_s"]` (a slow
cold start) and appends a line per load to `config["load_log"]` when given.

`fake_embed` (batched, max 8; `openai="embeddings"`, alias `fake-embedding-3`,
dimensions 3): each text becomes `[characters, words, 0.5]`, its usage the words
counted; every batch's size goes to `BATCHES`. A text "hold" holds its batch in
the handler thread until the test sets `GATE` (later requests queue and batch).

`fake_chat` (a generator; `openai=("chat", "completions")`, alias `fake-chat`):
echoes the prompt (a chat's last message) one word per item, up to
`max_tokens` words ("length"), stopping before a word in `stop` ("stop");
then `{"text": "", "finish_reason", "usage"}`. Every event it gets goes to
`EVENTS`. A prompt of "fail midway" yields one word and raises.

`plain` serves no OpenAI operation.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from runtime import Batch, Context, InvalidInput, OpenAI, bundle, handler

BATCHES: list[int] = []
EVENTS: list[dict[str, Any]] = []
GATE = threading.Event()


class Lexicon:
    pass


@bundle("lexicon")
def build_lexicon(weights: dict[str, Any], config: dict[str, Any]) -> Lexicon:
    time.sleep(float(config.get("sleep_s", 0.0)))
    log = config.get("load_log")
    if log:
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()} {time.time()}\n")
    return Lexicon()


@handler(
    "fake_embed",
    uses=["lexicon"],
    batch=Batch(max_size=8, max_wait_ms=20),
    openai=OpenAI("embeddings", aliases=["fake-embedding-3"], dimensions=3),
)
def fake_embed(
    events: list[Any], lexicon: Lexicon, ctxs: list[Context]
) -> list[dict[str, Any] | InvalidInput]:
    BATCHES.append(len(events))
    held = any(isinstance(e, dict) and e.get("texts") == ["hold"] for e in events)
    if held and not GATE.wait(timeout=120):
        raise TimeoutError("the test never opened the gate")
    outputs: list[dict[str, Any] | InvalidInput] = []
    for event in events:
        texts = event.get("texts") if isinstance(event, dict) else None
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            outputs.append(InvalidInput("texts", "must be a list of strings"))
            continue
        if any(len(t) > 1000 for t in texts):
            outputs.append(InvalidInput("texts", "a text is over 1000 characters"))
            continue
        outputs.append(
            {
                "embeddings": [[float(len(t)), float(len(t.split())), 0.5] for t in texts],
                "usage": {"prompt_tokens": sum(len(t.split()) for t in texts)},
            }
        )
    return outputs


def _join(items: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"text": "".join(item["text"] for item in items)}
    if items and "finish_reason" in items[-1]:
        out.update(finish_reason=items[-1]["finish_reason"], usage=items[-1]["usage"])
    return out


@handler(
    "fake_chat",
    uses=["lexicon"],
    join=_join,
    openai=OpenAI("chat", "completions", aliases=["fake-chat"]),
)
def fake_chat(event: dict[str, Any], lexicon: Lexicon, ctx: Context) -> Any:
    EVENTS.append(event)
    source = event["prompt"] if "prompt" in event else event["messages"][-1]["content"]
    limit = event.get("max_tokens", 16)
    if not isinstance(limit, int) or not 1 <= limit <= 64:
        raise InvalidInput("max_tokens", "must be an integer from 1 to 64")
    temperature = event.get("temperature", 0.0)
    if not isinstance(temperature, int | float) or not 0 <= temperature <= 2:
        raise InvalidInput("temperature", "must be between 0 and 2")
    words = source.split()
    stop = set(event.get("stop", []))
    sent = 0
    reason = "stop"
    for word in words:
        if word in stop:
            break
        if sent == limit:
            reason = "length"
            break
        yield {"text": word if sent == 0 else " " + word}
        sent += 1
        if source == "fail midway":
            raise RuntimeError("the fake model failed midway")
    yield {
        "text": "",
        "finish_reason": reason,
        "usage": {"prompt_tokens": len(words), "completion_tokens": sent},
    }


@handler("plain")
def plain(event: Any, ctx: Context) -> dict[str, Any]:
    return {"event": event}
