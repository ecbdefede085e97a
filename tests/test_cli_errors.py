"""#15 from the command line: each mistake prints `stratagem: error: ...` (exit 1), names the
key, value or file, and leaves every file of the work dir as it was."""

import os
import shutil

import pytest
import torch

from stratagem import checkpoint as ckpt
from stratagem.checkpoint.latest import update_pointer
from stratagem.cli import main
from stratagem.config import ConfigWarning
from workdir_snapshot import assert_unchanged, snapshot

YAML = """\
model: {type: MLPClassifier, in_features: 8, num_classes: 3, hidden: 16}
train_dataloader:
  dataset: {type: SyntheticClassification, num_samples: 64, num_features: 8, num_classes: 3}
  batch_size: 16
optim_wrapper:
  optimizer: {type: SGD, lr: LR, momentum: 0.9, weight_decay: 5e-4}
train_cfg: {max_iters: 4, checkpoint_interval: 2}
randomness: {seed: 0}
"""


def _config(tmp_path, lr='1e-3', name='cfg.yaml'):
    path = tmp_path / name
    path.write_text(YAML.replace('LR', lr))
    return str(path)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A work dir of a finished run (iter_2, iter_4, the pointer), trained from a YAML file
    whose lr is written `1e-3`: PyYAML reads a string, which is converted with a warning."""
    tmp = tmp_path_factory.mktemp('cli')
    work = tmp / 'work'
    with pytest.warns(ConfigWarning) as record:
        assert main(['train', _config(tmp), '--work-dir', str(work)]) == 0
    text = str(record[0].message)
    assert "optim_wrapper.optimizer.lr='1e-3'" in text and 'cfg.yaml' in text
    assert "optim_wrapper.optimizer.weight_decay='5e-4'" in text
    assert torch.load(work / 'iter_4.pth', weights_only=True)['meta']['iter'] == 4
    return work


def _copy(trained, tmp_path):
    work = tmp_path / 'work'
    shutil.copytree(trained, work)
    update_pointer(work, work / 'iter_4.pth')  # the copy points at its own files
    return work


def _error(capsys, argv):
    assert main(argv) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith('stratagem: warning')]
    assert lines[0].startswith('stratagem: error: ') and 'Traceback' not in err
    assert '--debug or STRATAGEM_DEBUG=1' in lines[-1]
    return err


def test_string_that_is_not_a_number(trained, tmp_path, capsys):
    """Case 1: the key, the value and the file are named; nothing in the work dir changes."""
    work = _copy(trained, tmp_path)
    before = snapshot(work)
    cfg = _config(tmp_path, lr='fast')
    err = _error(capsys, ['train', cfg, '--work-dir', str(work), '--resume'])
    assert f"optim_wrapper.optimizer.lr='fast' in {cfg} must be a number" in err
    assert '(ConfigError;' in err
    assert_unchanged(work, before, allow_log=False)


def test_resume_whose_pointer_names_a_missing_file(trained, tmp_path, capsys):
    """Case 2: an error naming the pointer and the file, before anything is written."""
    work = _copy(trained, tmp_path)
    for name in ('iter_2.pth', 'iter_4.pth'):
        os.remove(work / name)
        os.remove(work / f'{name}.manifest.json')
    before = snapshot(work)
    with pytest.warns(ckpt.CheckpointWarning, match='holds no other committed checkpoint'):
        err = _error(capsys, ['train', _config(tmp_path), '--work-dir', str(work), '--resume'])
    assert (
        f'cannot resume from work_dir {work}: its last_checkpoint points to '
        f'{work / "iter_4.pth"}, which does not exist' in err
    )
    assert 'nothing was changed' in err and '--resume PATH' in err
    assert_unchanged(work, before)


def test_bad_files_given_to_resume_or_load_from(trained, tmp_path, capsys):
    """Case 3 and 6: an unknown layout, a truncated file, a work dir where a file was meant."""
    work = _copy(trained, tmp_path)
    files = tmp_path / 'files'
    files.mkdir()
    weights = torch.load(work / 'iter_4.pth', weights_only=True)['state_dict']
    torch.save({'epoch': 4, 'weights': weights}, files / 'weights.pth')
    data = (work / 'iter_4.pth').read_bytes()
    (files / 'truncated.pth').write_bytes(data[: len(data) // 2])
    before, before_files = snapshot(work), snapshot(files)
    cfg = _config(tmp_path)
    err = _error(
        capsys, ['train', cfg, '--work-dir', str(work), '--load-from', str(files / 'weights.pth')]
    )
    assert f'{files / "weights.pth"} holds no model weights' in err
    assert "'epoch' (int), 'weights' (dict of 6)" in err
    err = _error(
        capsys, ['train', cfg, '--work-dir', str(work), '--load-from', str(files / 'truncated.pth')]
    )
    assert f'{files / "truncated.pth"} is truncated: it is {len(data) // 2} bytes' in err
    err = _error(capsys, ['train', cfg, '--work-dir', str(work), '--resume', str(work)])
    assert f'{work} is a work directory, not a checkpoint file' in err
    assert str(work / 'iter_4.pth') in err and f'--work-dir {work} --resume' in err
    assert_unchanged(work, before)
    assert_unchanged(files, before_files, allow_log=False)


def test_device_and_missing_sections(tmp_path, capsys):
    """Case 6: device='gpu'; an mmcv-style config without optim_wrapper."""
    work = tmp_path / 'new'
    err = _error(
        capsys,
        [
            'train',
            _config(tmp_path, lr='0.1'),
            '--work-dir',
            str(work),
            '--cfg-options',
            'strategy.device=gpu',
        ],
    )
    assert "device='gpu' is not a device name (did you mean 'cuda'?)" in err
    assert not work.exists()
    old = tmp_path / 'old.py'
    old.write_text(
        "model = dict(type='MLPClassifier', in_features=8, num_classes=3)\n"
        "optimizer = dict(type='SGD', lr=0.1)\n"
        "train_dataloader = dict(dataset=dict(type='SyntheticClassification'))\n"
    )
    err = _error(capsys, ['train', str(old), '--work-dir', str(work)])
    assert f'config {old} has no optim_wrapper' in err
    assert 'optim_wrapper=dict(optimizer=dict(...))' in err
    assert not work.exists()


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    cfg = _config(tmp_path, lr='fast')
    from stratagem.config import ConfigError

    with pytest.raises(ConfigError, match='must be a number'):
        main(['train', cfg, '--debug'])
    monkeypatch.setenv('STRATAGEM_DEBUG', '1')
    with pytest.raises(ConfigError, match='must be a number'):
        main(['train', cfg])
