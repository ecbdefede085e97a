"""FSDPStrategy (FSDP2) in one place: the strategy (``strategy.py``), its checkpoint storage
(``storage.py``), mmengine's and FSDP1's config forms mapped to FSDP2 (``config.py``,
``wrap_policy.py``), its wrapping sequence (``shard.py``, which ``stratagem doctor`` shares),
and the no-sync control, pending gradients and optim-wrapper fit it composes
(``grad_sync.py``).
Importing this package imports ``torch.distributed.fsdp``; ``stratagem.strategies`` registers
``'FSDPStrategy'`` lazily.
"""

from .storage import FSDPStorage
from .strategy import FSDPStrategy

__all__ = ['FSDPStrategy', 'FSDPStorage']
