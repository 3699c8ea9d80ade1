"""Memory-aware architectures: MobileNet's depthwise-separable convolution, its width and resolution multipliers,
and the FLOPs and bytes of a convolution for the roofline.

Howard et al. 2017, "MobileNets: Efficient Convolutional Neural Networks for Mobile Vision Applications":

  standard 3x3 convolution     K*K*M*N weights, K*K*M*N*F*F multiply-adds (M in, N out channels, F x F output)
  depthwise separable          K*K*M + M*N weights: a K x K filter per input channel (groups=M), then a 1 x 1
                               "pointwise" convolution; cost ratio 1/N + 1/K^2 (their eq. 5)
  width multiplier alpha       every layer's channels times alpha: cost and parameters "roughly alpha^2" (sec. 3.3)
  resolution multiplier rho    the input side times rho: cost rho^2, parameters unchanged (sec. 3.4)

`mobilenet_v1(alpha)` is their Table 1 (13 separable blocks; the second-to-last depthwise layer, printed with
stride 2 in the table, runs at stride 1 as the 7x7 output size in the same table implies); every convolution is
followed by batch norm and ReLU; no bias. `vgg16()` is Simonyan and Zisserman's configuration D, to count the
parameters the MobileNet paper compares with. Build them on the meta device to count without allocating.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..core.dtypes import dtype_bytes
from ..core.validate import flag, number_in, pos_int
from ..hardware.hierarchy import OpCost

__all__ = ["conv_bn_relu", "SeparableBlock", "StandardBlock", "MOBILENET_V1", "mobilenet_v1", "vgg16",
           "param_count", "conv2d_cost", "scaled_channels"]

# (output channels, stride) of each depthwise-separable block: Howard et al. 2017, Table 1
MOBILENET_V1 = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1), (512, 1), (512, 1),
                (512, 1), (512, 1), (1024, 2), (1024, 1)]


def scaled_channels(channels: int, alpha: float) -> int:
    """round(alpha * channels), at least 1: the width multiplier applied to one layer."""
    pos_int("channels", channels)
    number_in("alpha", alpha, 0, 1, hi_open=False, what="a number in (0, 1]")
    if alpha <= 0:
        raise ValueError(f"alpha must be a number in (0, 1], got {alpha!r}")
    return max(1, round(alpha * channels))


def conv_bn_relu(c_in: int, c_out: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """Conv2d (no bias, 'same' padding) -> BatchNorm2d -> ReLU."""
    for nm, v in (("c_in", c_in), ("c_out", c_out), ("kernel", kernel), ("stride", stride), ("groups", groups)):
        pos_int(nm, v)
    if c_in % groups or c_out % groups:
        raise ValueError(f"groups must divide c_in and c_out, got c_in={c_in}, c_out={c_out}, groups={groups}")
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class SeparableBlock(nn.Sequential):
    """Depthwise 3x3 (one filter per channel, groups=c_in) + BN + ReLU, then pointwise 1x1 + BN + ReLU.
    Weights: 9*c_in + c_in*c_out (plus 2 per channel of each batch norm)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__(conv_bn_relu(c_in, c_in, 3, stride, groups=c_in), conv_bn_relu(c_in, c_out, 1))


class StandardBlock(nn.Sequential):
    """A standard 3x3 convolution + BN + ReLU with the same input and output as a SeparableBlock.
    Weights: 9*c_in*c_out (plus 2 per output channel of the batch norm)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__(conv_bn_relu(c_in, c_out, 3, stride))


def mobilenet_v1(alpha: float = 1.0, num_classes: int = 1000) -> nn.Sequential:
    """MobileNet v1 with width multiplier `alpha` (Howard et al. 2017, Table 1): a 3x3 stride-2 convolution to
    32*alpha channels, the 13 separable blocks of MOBILENET_V1, global average pooling, a linear classifier.
    4.23 million parameters at alpha = 1 (the paper's Table 8 says 4.2 million)."""
    pos_int("num_classes", num_classes)
    c = scaled_channels(32, alpha)
    layers = [conv_bn_relu(3, c, 3, 2)]
    for out, stride in MOBILENET_V1:
        layers.append(SeparableBlock(c, scaled_channels(out, alpha), stride))
        c = scaled_channels(out, alpha)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes)]
    return nn.Sequential(*layers)


def vgg16(num_classes: int = 1000) -> nn.Sequential:
    """VGG-16 (Simonyan and Zisserman 2015, configuration D) for 224 x 224 inputs: 13 3x3 convolutions with bias
    and ReLU in five stages with max pooling, then 4096-4096-num_classes fully connected layers:
    138,357,544 parameters for 1000 classes."""
    pos_int("num_classes", num_classes)
    layers, c = [], 3
    for stage in ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512)):
        for out in stage:
            layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU(inplace=True)]
            c = out
        layers.append(nn.MaxPool2d(2))
    layers += [nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Linear(4096, 4096),
               nn.ReLU(inplace=True), nn.Linear(4096, num_classes)]
    return nn.Sequential(*layers)


def param_count(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements (works on the meta device: counting needs no memory)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    flag("trainable_only", trainable_only)
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def conv2d_cost(batch: int, c_in: int, c_out: int, size: int, kernel: int = 3, stride: int = 1, groups: int = 1,
                dtype: torch.dtype | str = "fp32") -> OpCost:
    """FLOPs and minimum DRAM bytes of one Conv2d on a `size` x `size` input with 'same' padding (roofline
    convention of memlab.hardware: every input, weight and output moved once).
    FLOPs = 2 * batch * c_out * F^2 * (c_in / groups) * kernel^2 (F = ceil(size / stride)); bytes = (input +
    weights + output) * itemsize. A depthwise convolution (groups = c_in = c_out) does 2 * kernel^2 FLOPs per
    output element and moves two activations per output: about kernel^2 / (2 * itemsize) FLOP per byte."""
    for nm, v in (("batch", batch), ("c_in", c_in), ("c_out", c_out), ("size", size), ("kernel", kernel),
                  ("stride", stride), ("groups", groups)):
        pos_int(nm, v)
    if c_in % groups or c_out % groups:
        raise ValueError(f"groups must divide c_in and c_out, got c_in={c_in}, c_out={c_out}, groups={groups}")
    f = -(-size // stride)
    flops = 2 * batch * c_out * f * f * (c_in // groups) * kernel * kernel
    elems = batch * c_in * size * size + c_out * (c_in // groups) * kernel * kernel + batch * c_out * f * f
    kind = "depthwise conv" if groups == c_in == c_out and groups > 1 else f"conv {kernel}x{kernel}"
    return OpCost(kind, flops, elems * dtype_bytes(dtype))
