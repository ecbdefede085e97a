"""The model: a two-layer MLP that returns its loss and accuracy as a dict."""

import torch
from torch import nn
from torch.nn import functional as F

from stratagem.registry import MODELS


@MODELS.register_module()
class TinyNet(nn.Module):
    """``forward(inputs, targets)`` returns ``{'loss': cross entropy, 'acc': accuracy}``,
    both means over the batch: the reference loop trains on ``loss`` and logs every scalar,
    in training and in validation."""

    def __init__(self, in_features: int = 8, hidden: int = 32, num_classes: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc2(torch.relu(self.fc1(inputs)))
        loss = F.cross_entropy(logits, targets)
        acc = (logits.argmax(dim=1) == targets).float().mean()
        return {'loss': loss, 'acc': acc}
