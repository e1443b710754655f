"""`JobStore.now`'s refusal: a call that might wait, for a thread (runtime/jobs/store.py)."""

from __future__ import annotations

from typing import Final, TypeVar

T = TypeVar("T")


class NotNow:
    """What `JobStore.now` answers for a call that might wait: run it in a thread."""

    def __repr__(self) -> str:
        return "NOT_NOW"


NOT_NOW: Final = NotNow()
