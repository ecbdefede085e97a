"""revise_keys and load_state_dict: mmengine semantics, one readable report."""
import logging
from collections import OrderedDict

import pytest
import torch
from torch import nn

from stratagem.checkpoint import LoadReport, load_state_dict, revise_keys


class Net(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.fc = nn.Linear(width, 3)
        self.bn = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 2)


def test_revise_keys_default_and_order():
    sd = OrderedDict([('module.fc.weight', 1), ('module.bn.bias', 2), ('head.module.x', 3)])
    assert list(revise_keys(sd)) == ['fc.weight', 'bn.bias', 'head.module.x']
    rules = [(r'^backbone\.', ''), (r'^fc', 'classifier')]
    out = revise_keys({'backbone.fc.w': 1, 'fc.b': 2}, rules)
    assert out == OrderedDict([('classifier.w', 1), ('classifier.b', 2)])
    sd._metadata = OrderedDict([('', {'version': 1}), ('module.bn', {'version': 2})])
    assert revise_keys(sd)._metadata == OrderedDict([('', {'version': 1}), ('bn', {'version': 2})])


def test_revise_keys_errors():
    with pytest.raises(ValueError, match="both 'module.a' and 'a'"):
        revise_keys({'module.a': 1, 'a': 2})
    with pytest.raises(TypeError, match='pairs'):
        revise_keys({'a': 1}, [r'^module\.'])
    with pytest.raises(ValueError, match='not a valid regex'):
        revise_keys({'a': 1}, [('(', '')])


def test_perfect_match_and_ddp_like_unwrap():
    src, dst = Net(), Net()
    report = load_state_dict(nn.DataParallel(dst), src.state_dict(), strict=True)
    assert report.ok and str(report) == 'all keys matched'
    assert torch.equal(dst.fc.weight, src.fc.weight)


def test_mismatch_report_non_strict(caplog):
    src, dst = Net(width=5), Net(width=4)
    sd = src.state_dict()
    del sd['head.bias']
    sd['extra.weight'] = torch.ones(1)
    before = dst.fc.weight.clone()
    with caplog.at_level(logging.WARNING, logger='stratagem.checkpoint'):
        report = load_state_dict(dst, sd)
    assert report.shape_mismatches == [('fc.weight', (3, 5), (3, 4))]
    assert report.missing_keys == ['head.bias']
    assert report.unexpected_keys == ['extra.weight']
    assert torch.equal(dst.fc.weight, before)            # skipped, not half-copied
    assert torch.equal(dst.fc.bias, src.fc.bias)         # the rest loaded
    text = caplog.records[0].getMessage()
    for fragment in ('fc.weight: (3, 5) -> (3, 4)', '1 missing key(s)', 'head.bias',
                     '1 unexpected key(s)', 'extra.weight'):
        assert fragment in text
    assert 'fc.weight' not in report.missing_keys


def test_strict_raises_with_full_message():
    dst = Net()
    sd = {f'module.{k}': v for k, v in Net().state_dict().items()}
    with pytest.raises(RuntimeError) as info:
        load_state_dict(dst, sd, strict=True)
    message = str(info.value)
    assert 'missing key(s)' in message and 'unexpected key(s)' in message
    assert "extra prefix 'module.'" in message and 'revise_keys' in message
    assert load_state_dict(dst, revise_keys(sd), strict=True).ok


def test_custom_logger_and_bad_input():
    logger = logging.getLogger('my.trainer')
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        sd = Net().state_dict()
        sd['nope'] = torch.ones(1)
        report = load_state_dict(Net(), sd, logger=logger)
    finally:
        logger.removeHandler(handler)
    assert isinstance(report, LoadReport) and not report.ok and len(records) == 1
    with pytest.raises(TypeError, match='state_dict'):
        load_state_dict(Net(), [1, 2])
