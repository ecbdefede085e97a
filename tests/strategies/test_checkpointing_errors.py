"""#15 through the strategy: foreign and mismatched checkpoints, resumes that cannot resume.

Each case asserts the message (file, key, what the file holds) and that the model, the
optimizer and every file in the work dir are unchanged afterwards.
"""

import os
import warnings

import pytest
import torch
from torch import nn

from stratagem import checkpoint as ckpt
from stratagem.strategies import SingleDeviceStrategy
from workdir_snapshot import assert_unchanged, snapshot

OPTIM = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))


def _net(width=8):
    torch.manual_seed(width)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def _prepared(work_dir, width=8, schedulers=1, optim=OPTIM):
    s = SingleDeviceStrategy(work_dir=str(work_dir), env_kwargs=dict(randomness=dict(seed=1)))
    out = s.prepare(
        _net(width),
        optim_wrapper=optim,
        param_scheduler=[dict(type='ConstantLR')] * schedulers,
        dispatch_kwargs=dict(max_iters=10),
    )
    return s, out[0], out[1]


def _state(model, optim_wrapper):
    """Model tensors and the optimizer state, as bytes: comparable with ==."""
    import io

    buffer = io.BytesIO()
    torch.save({'model': model.state_dict(), 'optim': optim_wrapper.state_dict()}, buffer)
    return buffer.getvalue()


def _step(model, optim_wrapper):
    optim_wrapper.update_params(model(torch.randn(3, 4)).sum())


def test_foreign_layouts_load_and_a_file_matching_nothing_is_an_error(tmp_path):
    """Case 3: the PyTorch tutorial's checkpoint loads its 'model' entry; nothing matching or
    no known layout is an error naming the file and what it holds; the model is unchanged."""
    s, model, ow = _prepared(tmp_path / 'work')
    src = _net(8)
    files = tmp_path / 'files'
    files.mkdir()
    torch.save({'model': src.state_dict(), 'optimizer': {}, 'epoch': 3}, files / 'tutorial.pth')
    torch.save(
        {'model_state_dict': {f'module.{k}': v for k, v in src.state_dict().items()}},
        files / 'ddp.pth',
    )
    torch.save({'epoch': 3, 'weights': src.state_dict()}, files / 'weights.pth')
    torch.save({'backbone.w': torch.ones(2)}, files / 'other.pth')
    warnings.simplefilter('ignore', ckpt.UnverifiedCheckpointWarning)
    for name in ('tutorial.pth', 'ddp.pth'):
        model[0].weight.data.zero_()
        s.load_checkpoint(str(files / name))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in src.state_dict().items())
    before_files = snapshot(files)
    before = _state(model, ow)
    with pytest.raises(ckpt.StateDictMismatchError) as info:
        s.load_checkpoint(str(files / 'weights.pth'))
    message = str(info.value)
    assert str(files / 'weights.pth') in message and 'no model weights' in message
    assert "'epoch' (int), 'weights' (dict of 4)" in message
    with pytest.raises(ckpt.StateDictMismatchError) as info:
        s.load_checkpoint(str(files / 'other.pth'))
    message = str(info.value)
    assert (
        f'{files / "other.pth"} (a bare state dict): none of its 1 entries matches '
        'Sequential, so nothing was loaded' in message
    )
    assert '0.weight' in message and 'backbone.w' in message
    assert _state(model, ow) == before
    assert_unchanged(files, before_files, allow_log=False)


def test_strict_shape_mismatch_and_partial_loads(tmp_path):
    """Case 4: a strict load with other shapes raises before copying anything; a non-strict
    one that finds under half of the model warns, listing what was not loaded."""
    s, model, ow = _prepared(tmp_path / 'work')
    wide = tmp_path / 'wide.pth'
    torch.save({'state_dict': _net(9).state_dict()}, wide)
    before, before_files = _state(model, ow), snapshot(tmp_path)
    warnings.simplefilter('ignore', ckpt.UnverifiedCheckpointWarning)
    with pytest.raises(RuntimeError) as info:
        s.load_checkpoint(str(wide), strict=True)
    message = str(info.value)
    assert f"{wide} (its 'state_dict' entry)" in message and 'nothing was loaded' in message
    assert '0.weight: (9, 4) -> (8, 4)' in message and "'state_dict' (dict of 4)" in message
    assert _state(model, ow) == before  # 2.bias fits and would have been copied by torch
    assert_unchanged(tmp_path, before_files)
    with pytest.warns(ckpt.PartialLoadWarning) as record:
        s.load_checkpoint(str(wide))
    (text,) = [str(w.message) for w in record if w.category is ckpt.PartialLoadWarning]
    assert f'{wide}' in text and 'only 1 of the 4 tensors of Sequential' in text
    assert 'not loaded: 0.weight, 0.bias, 2.weight' in text


def test_resume_of_another_run_changes_nothing(tmp_path):
    """A checkpoint of another model, optimizer grouping or scheduler list is refused before
    the model, the optimizer or the RNG are touched."""
    others = []
    for i, kw in enumerate(
        [
            dict(width=9),
            dict(optim={**OPTIM, 'paramwise_cfg': dict(custom_keys={'0.': dict(lr_mult=0.1)})}),
            dict(schedulers=2),
        ]
    ):
        o, om, oow = _prepared(tmp_path / f'other{i}', **kw)
        _step(om, oow)
        others.append(o.save_checkpoint('iter_1.pth', extra_ckpt={'meta': {'iter': 1}}))
    s, model, ow = _prepared(tmp_path / 'work')
    _step(model, ow)
    before, rng = _state(model, ow), torch.get_rng_state()
    before_files = snapshot(tmp_path)
    expected = ['its weights do not fit Sequential', '0.weight: (9, 4) -> (8, 4)']
    with pytest.raises(ckpt.StateDictMismatchError, match='cannot resume') as info:
        s.resume(others[0])
    assert all(e in str(info.value) for e in expected) and others[0] in str(info.value)
    with pytest.raises(
        ValueError,
        match=r'its optimizer has param groups of sizes \[2, 2\], '
        r'this run builds \[4\]',
    ):
        s.resume(others[1])
    with pytest.raises(ValueError, match='holds 2 param scheduler state'):
        s.resume(others[2])
    assert _state(model, ow) == before and torch.equal(torch.get_rng_state(), rng)
    assert s.resumed_from is None
    assert_unchanged(tmp_path, before_files)


def test_resume_that_cannot_resume_stops_before_writing(tmp_path):
    """Case 2 (API): the pointer names a missing file and nothing else verifies: an error
    naming both, not a fresh start that would overwrite the work dir."""
    work = tmp_path / 'work'
    s, model, ow = _prepared(work)
    path = s.save_checkpoint('iter_2.pth', extra_ckpt={'meta': {'iter': 2}})
    os.remove(path)
    os.remove(path + '.manifest.json')
    before = snapshot(work)
    s2, _, _ = _prepared(work)
    with pytest.warns(ckpt.CheckpointWarning):
        with pytest.raises(FileNotFoundError) as info:
            s2.load_or_resume(resume=True)
    message = str(info.value)
    assert f'cannot resume from work_dir {work}' in message
    assert f'last_checkpoint points to {path}, which does not exist' in message
    assert 'nothing was changed' in message and '--resume PATH' in message
    assert_unchanged(work, before)
    # the pointer names a file whose bytes no longer match its manifest
    s5, _, _ = _prepared(work)
    path = s5.save_checkpoint('iter_3.pth', extra_ckpt={'meta': {'iter': 3}})
    with open(path, 'r+b') as file:
        file.seek(100)
        byte = file.read(1)
        file.seek(100)
        file.write(bytes([byte[0] ^ 0xFF]))
    before = snapshot(work)
    with pytest.warns(ckpt.CheckpointWarning, match='damaged'):
        with pytest.raises(FileNotFoundError, match=f'points to {path}, which is damaged'):
            _prepared(work)[0].load_or_resume(resume=True)
    assert_unchanged(work, before)
    # a work dir with only foreign checkpoint files is not a fresh start either
    foreign = tmp_path / 'foreign'
    foreign.mkdir()
    torch.save(model.state_dict(), foreign / 'epoch_3.pth')
    s3, _, _ = _prepared(foreign)
    with pytest.raises(FileNotFoundError, match='holds checkpoint file.s. epoch_3.pth'):
        s3.load_or_resume(resume=True)
    # a work dir that never held a checkpoint is: resume=True starts from scratch
    s4, _, _ = _prepared(tmp_path / 'fresh')
    assert s4.load_or_resume(resume=True) is None


@pytest.mark.parametrize(
    'damage',
    [
        pytest.param(lambda rng: rng['torch'].resize_(7), id='torch-state-cut'),
        pytest.param(lambda rng: rng['numpy'].pop('bit_generator'), id='numpy-key-missing'),
        pytest.param(lambda rng: rng['numpy'].update(bit_generator='MT0'), id='numpy-unknown'),
    ],
)
def test_an_rng_state_that_cannot_be_restored_is_a_named_error(tmp_path, damage):
    """The manifest vouches for the bytes, not for what was written: an RNG state this run
    cannot restore is refused before anything loads, naming the file and the rank."""
    s, model, ow = _prepared(tmp_path / 'work')
    _step(model, ow)

    def write_it_wrong(checkpoint):
        damage(checkpoint['rng_states'][0])

    path = s.save_checkpoint('bad.pth', extra_ckpt={'meta': {'iter': 1}}, callback=write_it_wrong)
    s2, model2, ow2 = _prepared(tmp_path / 'work2')
    before = _state(model2, ow2)
    draw = torch.get_rng_state()
    with pytest.raises(ckpt.CheckpointCorruptError, match=r'bad\.pth: rng_states\[0\]'):
        s2.resume(path)
    assert _state(model2, ow2) == before  # nothing was loaded
    assert torch.equal(torch.get_rng_state(), draw)  # this process's RNG as it was
