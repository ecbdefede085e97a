"""Small example models for the reference loop, the demo and the tests (registered in MODELS).

A model used by ``stratagem train`` takes a batch ``(inputs, targets)`` and, in
training, returns its loss: a tensor, or a dict of tensors whose ``loss*``
entries are summed (mmengine's ``parse_losses`` convention).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from stratagem.registry import MODELS


@MODELS.register_module()
class MLPClassifier(nn.Module):
    """An MLP classifier: ``num_layers`` hidden Linear+ReLU (+ optional dropout/BatchNorm) layers.

    Args:
        in_features: Input width.
        num_classes: Output classes.
        hidden: Hidden width.
        num_layers: Hidden layers (>= 1).
        dropout: Dropout probability after each hidden layer (0 disables).
        batch_norm: Put a BatchNorm1d after each hidden Linear.
    """

    def __init__(self, in_features: int = 16, num_classes: int = 4, hidden: int = 64,
                 num_layers: int = 2, dropout: float = 0.0, batch_norm: bool = False) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f'MLPClassifier: num_layers must be >= 1, got {num_layers}')
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(num_layers):
            layers.append(nn.Linear(width, hidden))
            if batch_norm:
                layers.append(nn.BatchNorm1d(hidden))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Logits when ``targets`` is None, else ``{'loss': cross_entropy, 'acc': accuracy}``."""
        logits = self.head(self.backbone(inputs))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float(), targets)
        acc = (logits.detach().argmax(dim=1) == targets).float().mean()
        return {'loss': loss, 'acc': acc}
