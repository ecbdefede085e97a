"""fairscale's sharded DDP in one place: ``ShardedDDPStrategy`` (``strategy.py``) and the
``OSS`` optimizer it shards with (``oss.py``). fairscale is imported only when used.
"""

from .strategy import ShardedDDPStrategy

__all__ = ['ShardedDDPStrategy']
