"""Plain-torch model code behind the shipped handlers.

The model modules (minilm, llama, efficientnet) import torch at module level,
so only builders import them, never a handler module's top level: discovery
imports every handler module while the control interface starts. `fields`
stays torch-free and is shared by the handler modules for input checks.
"""
