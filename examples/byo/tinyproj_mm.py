"""tinyproj for mmengine's runner: an mmengine model and a validation metric (``BaseMetric``),
registered in mmengine's registries, with tinyproj's ``Blobs`` data.

``custom_imports=dict(imports=['tinyproj_mm'])`` in ``flexible_config.py`` imports it (found
beside the config). That config has ``val_evaluator``, which only mmengine's runner reads, so
``stratagem train flexible_config.py`` runs it under mmengine's ``FlexibleRunner`` on
stratagem's strategies; the strategy builds ``TinyMMNet`` through stratagem's registry, which
falls back to mmengine's.
"""

import torch
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, METRICS, MODELS
from tinyproj import Blobs
from torch import nn
from torch.nn import functional as F

DATASETS.register_module(module=Blobs, force=True)


@MODELS.register_module()
class TinyMMNet(BaseModel):
    """tinyproj's MLP with mmengine's modes: ``'loss'`` gives ``{'loss': cross entropy}``,
    ``'predict'`` one ``dict(logits=, label=)`` per sample, ``'tensor'`` the logits."""

    def __init__(self, in_features: int = 8, hidden: int = 32, num_classes: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, mode: str = 'tensor'):
        logits = self.fc2(torch.relu(self.fc1(inputs)))
        if mode == 'loss':
            return {'loss': F.cross_entropy(logits, labels)}
        if mode == 'predict':
            return [dict(logits=lg, label=lb) for lg, lb in zip(logits, labels)]
        return logits


@METRICS.register_module()
class TinyAccuracy(BaseMetric):
    """Accuracy and mean cross entropy over the whole validation set, logged as
    ``tiny/acc`` and ``tiny/nll``."""

    default_prefix = 'tiny'

    def process(self, data_batch, data_samples) -> None:
        for sample in data_samples:
            logits, label = sample['logits'].float(), sample['label']
            nll = F.cross_entropy(logits[None], label[None]).item()
            self.results.append((nll, float(logits.argmax() == label)))

    def compute_metrics(self, results: list) -> dict:
        return dict(
            nll=sum(r[0] for r in results) / len(results),
            acc=sum(r[1] for r in results) / len(results),
        )
