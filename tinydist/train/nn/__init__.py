"""Neural-network layers and losses over lazy tensors (torch.nn-style).

    model = td.nn.Sequential(td.nn.Linear(64, 128), td.nn.ReLU(), td.nn.Linear(128, 10))
    loss = td.nn.functional.cross_entropy(model(x), labels)

Parameters are leaf Tensors with `requires_grad=True`, initialised from the generator that
`td.manual_seed` seeds (torch's default schemes), so a seed fixes the model.
"""

from tinydist.train.nn import functional
from tinydist.train.nn.layers import (GELU, AvgPool2d, BatchNorm2d, Conv2d, Dropout, Embedding, Flatten, LayerNorm, Linear,
                                      MaxPool2d, ReLU, Sequential, Sigmoid, Tanh)
from tinydist.train.nn.module import Module, replicate

__all__ = ["AvgPool2d", "BatchNorm2d", "Conv2d", "Dropout", "Embedding", "Flatten", "GELU", "LayerNorm", "Linear",
           "MaxPool2d", "Module", "ReLU", "Sequential", "Sigmoid", "Tanh", "functional", "replicate"]
