"""ResNet models for the training-step benchmark, written here (torchvision is not needed).

- :func:`resnet18`: ResNet-18 in the ImageNet layout (He et al. 2016, table 1, as in
  torchvision): 7x7/2 stem convolution, batch norm, ReLU, 3x3/2 max pooling, four stages of two
  basic blocks (64, 128, 256, 512 channels; stages 2-4 start with stride 2 and a 1x1
  convolution + batch norm on the shortcut), global average pooling, a linear classifier.
  20 batch norms.
- :func:`resnet20`: the CIFAR ResNet-20 (He et al. 2016, section 4.2): a 3x3 convolution, three
  stages of three basic blocks (16, 32, 64 channels), the paper's parameter-free shortcut
  ("option A": subsample by 2 and pad the new channels with zeros), global average pooling, a
  linear classifier. 19 batch norms.

``width`` scales every stage (the tests build narrow models to stay fast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BasicBlock", "resnet18", "resnet20"]


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the shortcut, then ReLU (He et al. 2016).

    ``shortcut`` is applied to the block's input when the shape changes: a module (1x1 conv +
    BN), or None for the identity.
    """

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 shortcut: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = shortcut

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class _PadShortcut(nn.Module):
    """Option A: every other pixel, the ``extra`` new channels zero (no parameters)."""

    def __init__(self, extra: int):
        super().__init__()
        self.extra = extra

    def forward(self, x):
        low = self.extra // 2  # as many zero channels before as after (one more after if odd)
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, low, self.extra - low))


def _init(model: nn.Module) -> nn.Module:
    """torchvision's initialisation: He normal for convolutions, BN weight 1 and bias 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return model


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, inplanes = [], width
        for i in range(4):
            planes, stride = width * 2 ** i, 1 if i == 0 else 2
            shortcut = None
            if stride != 1 or inplanes != planes:
                shortcut = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                                         nn.BatchNorm2d(planes))
            stages.append(nn.Sequential(BasicBlock(inplanes, planes, stride, shortcut),
                                        BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet20(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 16, blocks: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages, inplanes = [], width
        for i in range(3):
            planes, stride = width * 2 ** i, 1 if i == 0 else 2
            shortcut = _PadShortcut(planes - inplanes) if stride != 1 else None
            layers = [BasicBlock(inplanes, planes, stride, shortcut)]
            layers += [BasicBlock(planes, planes) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*layers))
            inplanes = planes
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18(num_classes: int = 1000, width: int = 64) -> nn.Module:
    """ResNet-18, ImageNet layout (any input size of at least 32x32)."""
    return _init(ResNet18(num_classes, width))


def resnet20(num_classes: int = 10, width: int = 16) -> nn.Module:
    """CIFAR ResNet-20 (inputs 32x32 in the paper; any size divisible by 4)."""
    return _init(ResNet20(num_classes, width))
