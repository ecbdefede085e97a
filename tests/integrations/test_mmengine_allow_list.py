"""The mmengine allow-list: HistoryBuffer round-trips under weights_only, and a crafted
file cannot use HistoryBuffer.__setstate__ to rewrite the class's statistics table."""

import warnings

import pytest
import torch

pytest.importorskip('mmengine', reason='mmengine is not installed (pip install "stratagem[test]")')


def test_history_buffer_round_trips(tmp_path):
    from mmengine.logging import HistoryBuffer

    import stratagem.integrations.mmengine  # noqa: F401
    from stratagem.checkpoint import load_checkpoint_file, save_checkpoint

    buf = HistoryBuffer([1.0, 3.0], [1, 1], max_length=5)
    path = save_checkpoint({'hub': {'loss': buf}}, tmp_path / 'a.pth')
    got = load_checkpoint_file(path)['hub']['loss']
    assert isinstance(got, HistoryBuffer)
    assert got.data[0].tolist() == [1.0, 3.0] and got.max_length == 5
    assert got.statistics('mean') == 2.0
    again = save_checkpoint({'hub': {'loss': got}}, tmp_path / 'b.pth')  # saves once more
    assert load_checkpoint_file(again)['hub']['loss'].data[1].tolist() == [1, 1]


def test_crafted_state_cannot_rewrite_the_statistics_table(tmp_path):
    import numpy as np
    from mmengine.logging import HistoryBuffer

    import stratagem.integrations.mmengine  # noqa: F401
    from stratagem.checkpoint import load_checkpoint_file

    class Crafted:
        def __reduce__(self):
            return (HistoryBuffer, ([1.0], [1], 10), {'statistics_methods': {'mean': np.dtype}})

    path = tmp_path / 'crafted.pth'
    torch.save({'x': Crafted()}, path)
    mean = HistoryBuffer([1.0], [1])._statistics_methods['mean']
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try:
            load_checkpoint_file(path)
        except Exception:  # noqa: BLE001 - refusing the file is fine too
            pass
    assert HistoryBuffer([1.0], [1])._statistics_methods['mean'] is mean
    assert HistoryBuffer([1.0, 3.0], [1, 1]).statistics('mean') == 2.0
