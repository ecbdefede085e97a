"""FSDPStrategy (FSDP2) in one place: the strategy and its checkpoint layout (``strategy.py``),
mmengine's and FSDP1's config forms mapped to FSDP2 (``config.py``, ``wrap_policy.py``), and
the no-sync control, pending gradients and optim-wrapper fit it composes (``grad_sync.py``).
Importing this package imports ``torch.distributed.fsdp``; ``stratagem.strategies`` registers
``'FSDPStrategy'`` lazily.
"""

from .strategy import FSDPLayout, FSDPStrategy

__all__ = ['FSDPStrategy', 'FSDPLayout']
