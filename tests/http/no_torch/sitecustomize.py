"""Put on PYTHONPATH, makes this interpreter one where torch is not installed.

Python imports `sitecustomize` at start-up; this one puts a finder first on
`sys.meta_path` that answers for torch as a missing package does, so the
runtime meets exactly what `import torch` raises on a machine without it.
"""

from __future__ import annotations

import sys
from typing import Any


class NoTorch:
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, NoTorch())
