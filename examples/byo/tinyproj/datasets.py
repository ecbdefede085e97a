"""The data: labelled points around one centre per class, the same for a given seed."""

import torch
from torch.utils.data import Dataset

from stratagem.registry import DATASETS


@DATASETS.register_module()
class Blobs(Dataset):
    """``num_samples`` items ``(point, label)``: float32 points of ``in_features`` values
    around ``num_classes`` random centres, with noise of standard deviation ``noise``. The
    centres come from ``centre_seed`` and the points from ``seed``: sets with the same
    centres and other seeds (a training and a validation set) hold other points of one
    problem."""

    def __init__(
        self,
        num_samples: int = 256,
        in_features: int = 8,
        num_classes: int = 3,
        noise: float = 2.0,
        seed: int = 0,
        centre_seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(centre_seed)
        centres = torch.randn(num_classes, in_features, generator=g) * 2.0
        # the points' own stream, apart from the centres' (seed 0 must not replay them)
        g = torch.Generator().manual_seed(2**32 + seed)
        self.labels = torch.randint(num_classes, (num_samples,), generator=g)
        self.points = centres[self.labels] + noise * torch.randn(
            num_samples, in_features, generator=g
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[index], self.labels[index]
