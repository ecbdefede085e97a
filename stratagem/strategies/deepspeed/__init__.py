"""DeepSpeedStrategy in one place: the strategy (``strategy.py``), its config mapping
(``config.py``), its optim wrapper (``optim_wrapper.py``), its checkpoint layout and resume
(``checkpoint.py``), the capturing checkpoint engine that hands DeepSpeed's files to our writer
(``capture.py``) and the reading of DeepSpeed's directories (``files.py``, also used by
``stratagem convert``). DeepSpeed itself is imported only when an engine is built or its shards
are read; ``stratagem.strategies`` registers ``'DeepSpeedStrategy'`` lazily.
"""

from .strategy import DeepSpeedStrategy

__all__ = ['DeepSpeedStrategy']
