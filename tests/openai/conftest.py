"""The OpenAI routes under test: the fake handlers of tests/handlers/openai_fakes.py
over a real `lexicon` bundle in tmp_path, served on a real socket (`listening`),
called with the official `openai` package as a user calls it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.settings import Settings
from tests.inproc import settings_for
from tests.support import make_bundle

pytest.importorskip("openai")

HANDLERS = ("tests.handlers.openai_fakes",)


def openai_settings(root: Path, sleep_s: float = 0.0, **overrides: Any) -> Settings:
    """Settings serving the fake handlers, their bundle built under `root`."""
    bundles = root / "bundles"
    if not (bundles / "lexicon").exists():
        make_bundle(bundles, "lexicon", config={"sleep_s": sleep_s})
    return settings_for(root, handlers=HANDLERS, **overrides)
