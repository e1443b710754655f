"""EfficientNet-Lite0 in plain torch: ImageNet classification.

Lite variants drop squeeze-excite and swish (ReLU6 instead) and keep TF
"SAME" padding. No config ships with the checkpoint, so the block table is
here. The builder folds every BatchNorm into its convolution once, so a
request runs convolutions only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

IMAGE_SIZE = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BN_EPS = 1e-3
# (repeats, kernel, stride, expand ratio, in channels, out channels) per stage.
LITE0_STAGES = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)
IMAGENET_LABELS = Path(__file__).with_name("imagenet_classes.txt")


@dataclass(frozen=True)
class _Conv:
    weight: torch.Tensor
    bias: torch.Tensor
    stride: int
    groups: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.weight.shape[-1]
        if self.stride == 1:
            # SAME with stride 1 and an odd kernel is symmetric.
            return F.conv2d(x, self.weight, self.bias, padding=kernel // 2, groups=self.groups)
        # TF SAME with stride 2 pads more on the bottom/right than on the top/left.
        pads: list[int] = []
        for size in (x.shape[-1], x.shape[-2]):
            total = max((math.ceil(size / self.stride) - 1) * self.stride + kernel - size, 0)
            pads += [total // 2, total - total // 2]
        return F.conv2d(F.pad(x, pads), self.weight, self.bias, self.stride, groups=self.groups)


@dataclass(frozen=True)
class _Block:
    expand: _Conv | None
    depthwise: _Conv
    project: _Conv
    residual: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu6(self.expand(x)) if self.expand is not None else x
        h = self.project(F.relu6(self.depthwise(h)))
        return h + x if self.residual else h


class EfficientNetLite:
    def __init__(self, weights: Mapping[str, torch.Tensor], device: str) -> None:
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weights lack tensor {name!r}")
            used.add(name)
            return weights[name].to(device=device, dtype=torch.float32)

        def conv_bn(conv: str, bn: str, stride: int = 1, groups: int = 1) -> _Conv:
            w = take(f"{conv}.weight")
            scale = take(f"{bn}.weight") / torch.sqrt(take(f"{bn}.running_var") + BN_EPS)
            bias = take(f"{bn}.bias") - take(f"{bn}.running_mean") * scale
            folded = (w * scale[:, None, None, None]).contiguous(memory_format=torch.channels_last)
            return _Conv(folded, bias.contiguous(), stride, groups)

        self.stem = conv_bn("_conv_stem", "_bn0", stride=2)
        self.blocks: list[_Block] = []
        for repeats, _kernel, stride, expand, c_in, c_out in LITE0_STAGES:
            for r in range(repeats):
                p = f"_blocks.{len(self.blocks)}."
                inner = (c_in if r == 0 else c_out) * expand
                self.blocks.append(
                    _Block(
                        expand=conv_bn(p + "_expand_conv", p + "_bn0") if expand != 1 else None,
                        depthwise=conv_bn(
                            p + "_depthwise_conv",
                            p + "_bn1",
                            stride=stride if r == 0 else 1,
                            groups=inner,
                        ),
                        project=conv_bn(p + "_project_conv", p + "_bn2"),
                        residual=r > 0,
                    )
                )
        self.head = conv_bn("_conv_head", "_bn1")
        self.fc_w, self.fc_b = take("_fc.weight"), take("_fc.bias")
        unused = sorted(k for k in weights if k not in used and "num_batches_tracked" not in k)
        if unused:
            raise ValueError(f"{len(unused)} tensors are not part of Lite0, e.g. {unused[0]!r}")
        self.num_classes = self.fc_w.shape[0]
        self.mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """Logits for (N, 3, 224, 224) RGB pixels scaled to 0..1."""
        x = ((pixels - self.mean) / self.std).contiguous(memory_format=torch.channels_last)
        x = F.relu6(self.stem(x))
        for block in self.blocks:
            x = block(x)
        x = F.relu6(self.head(x)).mean(dim=(2, 3))
        return F.linear(x, self.fc_w, self.fc_b)


def read_labels(path: Path, num_classes: int) -> list[str]:
    labels = path.read_text(encoding="utf-8").splitlines()
    if len(labels) != num_classes:
        raise ValueError(f"{path.name} has {len(labels)} labels for {num_classes} classes")
    return labels


class ImageClassifier:
    """An `EfficientNetLite` with its preprocessing and class names."""

    image_size = IMAGE_SIZE

    def __init__(self, net: EfficientNetLite, labels_path: Path) -> None:
        self.net = net
        self.labels = read_labels(labels_path, net.num_classes)
        self.device = net.fc_w.device

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def classify(self, image: Any, top_k: int) -> list[dict[str, Any]]:
        """Top-k classes of an RGB PIL image, with softmax scores."""
        [labels] = self.classify_many([image], [top_k])
        return labels

    def classify_many(
        self, images: Sequence[Any], top_ks: Sequence[int]
    ) -> list[list[dict[str, Any]]]:
        """`classify` for several images in one forward pass (a batch of requests)."""
        from PIL import Image

        rows = []
        for image in images:
            # Bicubic resize to the full frame (no crop): the reference check gives
            # class 652 for grace_hopper.jpg this way.
            resized = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC)
            rows.append(torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0))
        batch = torch.stack(rows).permute(0, 3, 1, 2).to(self.device)
        with torch.inference_mode():
            probs = torch.softmax(self.net(batch).float(), dim=-1)
        out = []
        for row, top_k in zip(probs, top_ks, strict=True):
            scores, indices = row.topk(top_k)
            out.append(
                [
                    {"index": int(i), "label": self.labels[int(i)], "score": float(p)}
                    for p, i in zip(scores.tolist(), indices.tolist(), strict=True)
                ]
            )
        return out
