"""`fahrenheit`: a real torch module built from a real safetensors bundle.

The model is one linear neuron (bundles/tempconv) whose weights encode
F = 1.8 * C + 32; small enough to ship in git, real enough to exercise fetch,
load, init and warm-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runtime import Context, InvalidInput, bundle, handler

if TYPE_CHECKING:
    import torch

MAX_VALUES = 4096


@bundle("tempconv")
def build_tempconv(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str) -> Any:
    import torch

    model = torch.nn.Linear(config["in_features"], config["out_features"])
    model.load_state_dict({k.removeprefix("linear."): v for k, v in weights.items()})
    return model.to(device).eval()


@handler(
    "fahrenheit",
    uses=["tempconv"],
    warmup=[{"celsius": [0.0]}, {"celsius": [float(i) for i in range(MAX_VALUES)]}],
)
def fahrenheit(event: Any, model: Any, ctx: Context) -> dict[str, list[float]]:
    """Convert a list of Celsius temperatures to Fahrenheit."""
    import torch

    values = event.get("celsius") if isinstance(event, dict) else None
    if not isinstance(values, list) or not values:
        raise InvalidInput("celsius", "must be a non-empty list of numbers")
    if len(values) > MAX_VALUES:
        raise InvalidInput("celsius", f"at most {MAX_VALUES} values per request")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise InvalidInput("celsius", "every value must be a number")
    device = next(model.parameters()).device
    x = torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
    return {"fahrenheit": model(x).squeeze(1).tolist()}


__all__ = ["build_tempconv", "fahrenheit"]
