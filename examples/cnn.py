"""A CNN (HF transformers' ResNet, random init from a config) classifying 32x32 "images" cut
from stdlib source bytes by the file they came from.

    autoprec tune examples/cnn.py:task -o policies/cnn.yaml
"""

from __future__ import annotations

import torch

import autoprec
from examples.data import stdlib_bytes

__all__ = ["make_model", "image_batches", "task"]

_N_CLASSES = 10
_CHUNK = 200_000  # bytes of stdlib source per class


def make_model(width: int = 32):
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=width,
                       hidden_sizes=[width, 2 * width, 4 * width, 8 * width],
                       depths=[1, 1, 1, 1], num_labels=_N_CLASSES)
    return ResNetForImageClassification(cfg)


def image_batches(n_batches: int, batch_size: int = 32, *, seed: int = 0):
    """Batches ``{"pixel_values": [B,3,32,32], "labels": [B]}``: class c is bytes from the c-th
    200 kB of the stdlib stream, scaled to [-1, 1]."""
    stream = torch.frombuffer(bytearray(stdlib_bytes(_N_CLASSES * _CHUNK)), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    size = 3 * 32 * 32
    batches = []
    for _ in range(n_batches):
        labels = torch.randint(0, _N_CLASSES, (batch_size,), generator=gen)
        offs = torch.randint(0, _CHUNK - size, (batch_size,), generator=gen)
        imgs = torch.stack([stream[c * _CHUNK + o: c * _CHUNK + o + size]
                            for c, o in zip(labels.tolist(), offs.tolist())])
        pixels = imgs.float().div(127.5).sub(1.0).reshape(batch_size, 3, 32, 32)
        batches.append({"pixel_values": pixels, "labels": labels})
    return batches


def task(n_batches: int = 8, batch_size: int = 32, width: int = 32) -> autoprec.Task:
    return autoprec.Task(model=lambda: make_model(width), batches=image_batches(n_batches,
                                                                                batch_size, seed=1),
                         name=f"resnet-{width}-bytes")
