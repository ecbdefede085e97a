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
    assert torch.equal(dst.fc.weight, before)  # skipped, not half-copied
    assert torch.equal(dst.fc.bias, src.fc.bias)  # the rest loaded
    text = caplog.records[0].getMessage()
    for fragment in (
        'fc.weight: (3, 5) -> (3, 4)',
        '1 missing key(s)',
        'head.bias',
        '1 unexpected key(s)',
        'extra.weight',
    ):
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


# ---- #15: check everything before changing anything; foreign layouts; a load matching nothing
def _copy_state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _same(module, state):
    return all(torch.equal(module.state_dict()[k], v) for k, v in state.items())


def test_strict_mismatch_changes_nothing():
    from stratagem.checkpoint import StateDictMismatchError

    dst = Net(width=4)
    before = _copy_state(dst)
    sd = Net(width=5).state_dict()  # only fc.weight differs: torch would copy the rest first
    with pytest.raises(StateDictMismatchError) as info:
        load_state_dict(dst, sd, strict=True)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    message = str(info.value)
    assert 'nothing was loaded' in message and 'fc.weight: (3, 5) -> (3, 4)' in message
    assert "8 of the model's 9 tensors matched" in message
    assert _same(dst, before)  # nn.Module.load_state_dict would have copied bn and head


def test_non_tensor_values_are_reported_not_half_loaded():
    from stratagem.checkpoint import StateDictMismatchError

    dst = Net()
    before = _copy_state(dst)
    sd = Net().state_dict()
    sd['head.bias'] = [0.0, 0.0]
    with pytest.raises(StateDictMismatchError, match=r'head\.bias \(list\)'):
        load_state_dict(dst, sd, strict=True)
    assert _same(dst, before)
    report = load_state_dict(dst, sd)  # non-strict: the rest loads, the list is skipped
    assert report.type_mismatches == [('head.bias', 'list')] and report.loaded == 8
    assert torch.equal(dst.head.bias, before['head.bias'])


def test_a_load_matching_nothing_is_an_error_also_non_strict():
    from stratagem.checkpoint import StateDictMismatchError

    dst = Net()
    before = _copy_state(dst)
    with pytest.raises(StateDictMismatchError) as info:
        load_state_dict(dst, {'model': {}, 'optimizer': {}, 'epoch': 3})
    message = str(info.value)
    assert 'none of its 3 entries matches Net, so nothing was loaded' in message
    assert 'fc.weight' in message and 'model, optimizer, epoch' in message
    sd = {f'backbone.{k}': v for k, v in Net().state_dict().items()}
    with pytest.raises(StateDictMismatchError, match=r"extra prefix 'backbone\.'"):
        load_state_dict(dst, sd)
    assert _same(dst, before)


def test_old_batchnorm_state_without_num_batches_tracked_loads_strictly():
    src, dst = Net(), Net()
    sd = src.state_dict()
    del sd['bn.num_batches_tracked']
    sd._metadata = OrderedDict([('bn', {'version': 1})])  # saved before the key existed
    assert load_state_dict(dst, sd, strict=True).ok
    sd._metadata = OrderedDict([('bn', {'version': 2})])
    with pytest.raises(RuntimeError, match='bn.num_batches_tracked'):
        load_state_dict(dst, sd, strict=True)


@pytest.mark.parametrize('layout', ['state_dict', 'model_state_dict', 'model', 'module', 'bare'])
def test_find_model_weights_recognises_foreign_layouts(layout):
    from stratagem.checkpoint.state_dict import find_model_weights

    sd = Net().state_dict()
    ckpt = dict(sd) if layout == 'bare' else {layout: sd, 'optimizer': {'state': {}}, 'epoch': 4}
    found, where = find_model_weights(ckpt)
    assert list(found) == list(sd)
    assert where == ('a bare state dict' if layout == 'bare' else f"its '{layout}' entry")


def test_find_model_weights_names_what_the_file_holds():
    from stratagem.checkpoint import StateDictMismatchError
    from stratagem.checkpoint.state_dict import find_model_weights

    with pytest.raises(StateDictMismatchError) as info:
        find_model_weights({'epoch': 3, 'weights': Net().state_dict(), 'w': torch.ones(2, 3)})
    message = str(info.value)
    assert "'epoch' (int), 'weights' (dict of 9), 'w' (Tensor[2, 3])" in message
    assert "'state_dict', 'model_state_dict', 'model', 'module'" in message
    assert 'callback=' in message
