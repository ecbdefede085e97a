"""A user's own project, outside stratagem: a model, a dataset and a validation metric.

``custom_imports=dict(imports=['tinyproj'])`` in ``../config.py`` imports this package (found
beside the config) in every process before anything is built; importing it registers
``TinyNet`` in stratagem's MODELS and ``Blobs`` in its DATASETS.
"""

from .datasets import Blobs
from .models import TinyNet

__all__ = ['Blobs', 'TinyNet']
