"""stratagem convert: single file <-> sharded directory, round trip equal; damaged input named."""

import torch
from torch import nn

from stratagem.checkpoint import load_checkpoint_file, read_sharded_checkpoint, verify_checkpoint
from stratagem.cli import main


def _file_checkpoint(tmp_path):
    from stratagem.strategies import SingleDeviceStrategy

    s = SingleDeviceStrategy(work_dir=str(tmp_path / 'run'))
    torch.manual_seed(0)
    model, ow = s.prepare(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=0.01)),
    )
    for _ in range(2):
        ow.update_params(model(torch.randn(3, 4)).sum())
    return s.save_checkpoint(str(tmp_path / 'iter_2.pth'), extra_ckpt={'meta': {'iter': 2}})


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, torch.as_tensor(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_round_trip_equal(tmp_path, capsys):
    src = _file_checkpoint(tmp_path)
    assert main(['convert', src, str(tmp_path / 'sharded'), '--to', 'sharded']) == 0
    capsys.readouterr()
    assert main(['convert', str(tmp_path / 'sharded'), str(tmp_path / 'back.pth')]) == 0
    # stderr is no terminal here: no bar redrawn with carriage returns, one whole line at
    # the end (every file of the manifest verified)
    files = len(verify_checkpoint(tmp_path / 'sharded')['files'])
    err = capsys.readouterr().err
    assert '\r' not in err
    assert err == f'verifying [{"#" * 30}] {files}/{files}\n'
    assert verify_checkpoint(tmp_path / 'back.pth')['source_format'] == 'sharded'
    assert verify_checkpoint(tmp_path / 'sharded')['optimizer_keys'] == 'index'
    original = load_checkpoint_file(src)
    back = load_checkpoint_file(tmp_path / 'back.pth')
    for key in ('state_dict', 'optimizer', 'meta', 'rng_states'):
        assert _equal(original[key], back[key]), key
    assert _equal(
        original['state_dict'], read_sharded_checkpoint(tmp_path / 'sharded')['state_dict']
    )


def test_damaged_or_foreign_source_named(tmp_path, capsys):
    src = _file_checkpoint(tmp_path)
    main(['convert', src, str(tmp_path / 'sharded'), '--to', 'sharded'])
    shard = next((tmp_path / 'sharded').glob('__0_*.distcp'))
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(['convert', str(tmp_path / 'sharded'), str(tmp_path / 'x.pth')]) == 1
    err = capsys.readouterr().err
    assert shard.name in err and 'xxh3_128' in err and not (tmp_path / 'x.pth').exists()
    (tmp_path / 'foreign').mkdir()
    (tmp_path / 'foreign' / 'a.txt').write_text('hi')
    assert main(['convert', str(tmp_path / 'foreign'), str(tmp_path / 'y.pth')]) == 1
    assert 'foreign' in capsys.readouterr().err
    assert main(['convert', src, src]) == 1  # never overwrites
    assert 'exists' in capsys.readouterr().err
    # a dict without model weights cannot become a sharded checkpoint: the file is named
    torch.save({'model': {'w': torch.zeros(2)}}, tmp_path / 'plain.pth')
    assert (
        main(['convert', str(tmp_path / 'plain.pth'), str(tmp_path / 'z'), '--to', 'sharded']) == 1
    )
    err = capsys.readouterr().err
    assert f"{tmp_path / 'plain.pth'} has no model weights under 'state_dict'" in err
    assert "['model']" in err and not (tmp_path / 'z').exists()


def test_overwrite_replaces_an_existing_target(tmp_path, capsys):
    src = _file_checkpoint(tmp_path)
    dst = tmp_path / 'out.pth'
    assert main(['convert', src, str(dst)]) == 0
    first = verify_checkpoint(dst)
    capsys.readouterr()
    assert main(['convert', src, str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f'stratagem convert: error: {dst} exists;')  # one prefix, said once
    assert '--overwrite' in err
    # a sharded checkpoint replaces the file (and its sidecar manifest goes with it)
    sharded = tmp_path / 'sharded'
    assert main(['convert', src, str(sharded), '--to', 'sharded']) == 0
    assert main(['convert', str(sharded), str(dst), '--overwrite']) == 0
    again = verify_checkpoint(dst)
    assert again['source_format'] == 'sharded' and first['source_format'] != 'sharded'
    assert _equal(load_checkpoint_file(src)['state_dict'], load_checkpoint_file(dst)['state_dict'])
    # a file onto an existing directory
    assert main(['convert', src, str(sharded), '--overwrite']) == 0
    assert sharded.is_file()
    # never onto its own source
    capsys.readouterr()
    assert main(['convert', src, src, '--overwrite']) == 1
    assert 'would replace the source' in capsys.readouterr().err
