"""Handler outputs as OpenAI answer bodies, and a stream's items as OpenAI chunks.

    embeddings   {"object": "list", "data": [{"object": "embedding", "index",
                 "embedding": floats | base64 of little-endian float32}], "model", "usage"}
    chat         {"id": "chatcmpl-…", "object": "chat.completion", "created", "model",
                 "choices": [{"index": 0, "message": {"role": "assistant", "content"},
                 "finish_reason", "logprobs": null}], "usage"}
    completions  {"id": "cmpl-…", "object": "text_completion", …, "choices": [{"text", …}]}

A stream is one `data:` event per chunk: the first says the role (chat), each
item its text, the last its finish_reason, then, with
`stream_options.include_usage`, a chunk of no choices and the usage; then
`data: [DONE]`. Every chunk but that one has `"usage": null` when usage was
asked for, as OpenAI's have. The id is the request's own (X-Request-Id's).
An output that is not the shape the operation names is `invalid-output` (500).
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Mapping
from typing import Any

import orjson

from runtime.errors import InvalidOutput

DONE = b"data: [DONE]\n\n"


def _shape(handler: str, what: str) -> InvalidOutput:
    return InvalidOutput(
        f"handler {handler!r} returned {what}; its OpenAI operation needs the shape in "
        "runtime/wire/openai_spec.py",
        handler=handler,
    )


def _usage(handler: str, output: Mapping[str, Any], completion: bool) -> dict[str, int]:
    usage = output.get("usage") or {}
    if not isinstance(usage, Mapping):
        raise _shape(handler, "a usage that is not an object")
    counts = {"prompt_tokens": usage.get("prompt_tokens", 0)}
    if completion:
        counts["completion_tokens"] = usage.get("completion_tokens", 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in counts.values()):
        raise _shape(handler, "token counts that are not integers")
    return {**counts, "total_tokens": sum(counts.values())}


def embeddings_body(handler: str, model: str, output: Any, encoding: str) -> dict[str, Any]:
    vectors = output.get("embeddings") if isinstance(output, Mapping) else None
    if not isinstance(vectors, list):
        raise _shape(handler, "no list of embeddings")
    data = []
    for index, vector in enumerate(vectors):
        if encoding == "base64":
            try:
                packed = struct.pack(f"<{len(vector)}f", *vector)
            except (TypeError, struct.error) as exc:
                raise _shape(handler, f"an embedding that is not numbers ({exc})") from exc
            data.append(
                {
                    "object": "embedding",
                    "index": index,
                    "embedding": base64.b64encode(packed).decode(),
                }
            )
        else:
            data.append({"object": "embedding", "index": index, "embedding": vector})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": _usage(handler, output, completion=False),
    }


def _text(handler: str, output: Any) -> tuple[str, str | None]:
    if not isinstance(output, Mapping) or not isinstance(output.get("text"), str):
        raise _shape(handler, "no text")
    reason = output.get("finish_reason")
    if reason is not None and not isinstance(reason, str):
        raise _shape(handler, "a finish_reason that is not a string")
    return output["text"], reason


class Completion:
    """The answer to one chat or completion request, whole or as stream chunks."""

    def __init__(self, chat: bool, handler: str, model: str, request_id: str) -> None:
        self.chat = chat
        self.handler = handler
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, suffix: str = "") -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object + suffix,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def body(self, output: Any) -> dict[str, Any]:
        text, reason = _text(self.handler, output)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason or "stop", "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        return {
            **self._head(),
            "choices": [choice],
            "usage": _usage(self.handler, output, completion=True),
        }

    # ---- streamed -------------------------------------------------------------------

    def _chunk(
        self, text: str | None, reason: str | None, usage: bool, role: bool = False
    ) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice["delta"] = {"role": "assistant", **delta} if role else delta
        else:
            choice["text"] = text or ""
        chunk = {**self._head(".chunk" if self.chat else ""), "choices": [choice]}
        if usage:
            chunk["usage"] = None
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def first_chunk(self, usage: bool) -> bytes:
        """The chunk before any text: a chat's says the role."""
        if not self.chat:
            return b""
        return self._chunk("", None, usage, role=True)

    def item_chunk(self, item: Any, usage: bool) -> bytes:
        """One streamed item: its text (nothing when it has none, as the last has not)."""
        text, _reason = _text(self.handler, item)
        return self._chunk(text, None, usage) if text else b""

    def last_chunks(self, output: Any, usage: bool) -> bytes:
        """The chunk with the finish reason, the usage chunk if asked for, and [DONE]."""
        reason = _text(self.handler, output)[1]
        out = self._chunk(None, reason or "stop", usage)
        if usage:
            tail = {**self._head(".chunk" if self.chat else ""), "choices": []}
            tail["usage"] = _usage(self.handler, output, completion=True)
            out += b"data: " + orjson.dumps(tail) + b"\n\n"
        return out + DONE
