"""The real workloads fastpar is measured on (shared by ``benchmarks/`` and
``python -m fastpar bench``): the parameters of ``torch.nn.Transformer()`` and of a
4-layer bidirectional ``LSTM(1024, 1024)``, and 10,000 tensors of 64 floats."""
from __future__ import annotations

import warnings

import torch


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in module.parameters()]


def transformer_params(device="cpu") -> list[torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor notice
        return _params(torch.nn.Transformer().to(device))


def lstm_params(device="cpu") -> list[torch.Tensor]:
    return _params(torch.nn.LSTM(1024, 1024, 4, bidirectional=True).to(device))


def tiny_tensors(device="cpu", n: int = 10_000, size: int = 64) -> list[torch.Tensor]:
    return [torch.randn(size, device=device) for _ in range(n)]


#: name -> (builder, quick builder): the quick variants keep ``bench --quick`` short.
WORKLOADS = {
    "transformer": (transformer_params, lambda device="cpu": _params(
        torch.nn.Transformer(d_model=128, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                             dim_feedforward=256).to(device))),
    "lstm": (lstm_params, lambda device="cpu": _params(torch.nn.LSTM(128, 128, 2, bidirectional=True).to(device))),
    "tiny": (tiny_tensors, lambda device="cpu": tiny_tensors(device, n=1000)),
}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
