"""A handler module whose import fails: the instance cannot initialise."""

from __future__ import annotations

import thaw_test_module_that_does_not_exist  # noqa: F401
