"""Hugging Face checkpoints, both ways (``checkpoint/huggingface.py``): a tiny float64
``LlamaForCausalLM`` trained by a stratagem strategy, converted with ``stratagem convert
--to hf`` (one file, and shards), loads in ``from_pretrained`` with the same logits; the
directory (and one ``save_pretrained`` wrote, and one ``.safetensors`` file) loads back with
``load_checkpoint``, also into a 2-process FSDP model built from another seed, each rank
reading only its pieces; damaged files are refused naming them.

One spawn of 2 gloo ranks (tests/scenarios.py) for the FSDP checks; the rest in-process.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch

from scenarios import Scenarios
from stratagem.checkpoint.huggingface import read_hf

pytest.importorskip('safetensors')
pytest.importorskip('transformers')

STEPS = 3
SHARD = '20KB'  # the tiny Llama's 21 tensors (~43 KB in float64) make 3 shards
SCENARIOS = Scenarios(two=dict(nproc=2, timeout=240))


def _llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config).to(torch.float64)


def _ids():
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))


def _logits(model):
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def _train(strategy, seed):
    model, ow = strategy.prepare(
        _llama(seed), optim_wrapper=dict(optimizer=dict(type='AdamW', lr=0.01))
    )
    ids = _ids()
    for _ in range(STEPS):
        ow.update_params(model(input_ids=ids, labels=ids).loss)
    return model


def _quiet():
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


# ------------------------------------------------------------------ the test process
@pytest.fixture(scope='module')
def made(tmp_path_factory):
    """A trained model's checkpoint converted to hf (one file, shards) and one safetensors
    file; a save_pretrained directory (sharded) of another model; their logits."""
    from transformers import AutoModelForCausalLM

    from stratagem.cli import main
    from stratagem.strategies import SingleDeviceStrategy

    _quiet()
    tmp = tmp_path_factory.mktemp('hf')
    s = SingleDeviceStrategy(work_dir=str(tmp / 'run'), env_kwargs=dict(randomness=dict(seed=0)))
    model = _train(s, seed=0)
    src = s.save_checkpoint(str(tmp / f'iter_{STEPS}.pth'), extra_ckpt={'meta': {'iter': STEPS}})
    assert main(['convert', src, str(tmp / 'hf'), '--to', 'hf']) == 0
    assert (
        main(['convert', src, str(tmp / 'hf_shards'), '--to', 'hf', '--max-shard-size', SHARD]) == 0
    )
    assert main(['convert', src, str(tmp / 'one.safetensors')]) == 0
    other = AutoModelForCausalLM.from_pretrained(str(tmp / 'hf'))
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-0.5)
    other.save_pretrained(str(tmp / 'pretrained'), max_shard_size=SHARD)
    other.save_pretrained(str(tmp / 'pretrained_one'))
    # the model's weights less lm_head, plus one it lacks
    from stratagem.checkpoint.huggingface import save_hf_directory

    partial = dict(read_hf(tmp / 'hf')['state_dict'], **{'extra.w': torch.ones(2)})
    del partial['lm_head.weight']
    save_hf_directory(partial, tmp / 'partial', config_json='{}')
    torch.save(_logits(model), tmp / 'trained_logits.pt')
    torch.save(_logits(other), tmp / 'pretrained_logits.pt')
    return tmp


@pytest.fixture(scope='module')
def scenarios(request, made):
    return SCENARIOS.run(request, made)


def test_convert_to_hf_loads_in_from_pretrained(made):
    from transformers import AutoModelForCausalLM

    trained = torch.load(made / 'trained_logits.pt')
    one = sorted(p.name for p in (made / 'hf').iterdir())
    assert one == ['config.json', 'manifest.json', 'model.safetensors']
    shards = sorted(p.name for p in (made / 'hf_shards').iterdir())
    assert shards == [
        'config.json',
        'manifest.json',
        *[f'model-0000{i}-of-00003.safetensors' for i in (1, 2, 3)],
        'model.safetensors.index.json',
    ]
    for name in shards[2:5]:  # each shard at most 20 KB (none holds a tensor that large)
        assert (made / 'hf_shards' / name).stat().st_size <= 20_000 + 2_000  # + its header
    index = json.loads((made / 'hf_shards' / 'model.safetensors.index.json').read_text())
    assert len(index['weight_map']) == 21 and len(set(index['weight_map'].values())) == 3
    assert index['metadata']['total_size'] == sum(
        t.numel() * 8 for t in _llama(0).state_dict().values()
    )
    config = json.loads((made / 'hf' / 'config.json').read_text())
    assert config['architectures'] == ['LlamaForCausalLM'] and config['dtype'] == 'float64'
    assert config['hidden_size'] == 16 and config['num_hidden_layers'] == 2
    for out in ('hf', 'hf_shards'):
        model = AutoModelForCausalLM.from_pretrained(str(made / out))
        assert model.dtype == torch.float64
        assert torch.equal(_logits(model), trained), out


def test_load_checkpoint_reads_hf_directories_and_files(made, tmp_path):
    from stratagem.strategies import SingleDeviceStrategy

    trained = torch.load(made / 'trained_logits.pt')
    s = SingleDeviceStrategy(work_dir=str(tmp_path))
    model = s.prepare(_llama(seed=7))
    assert not torch.equal(_logits(model), trained)
    for name in ('hf', 'hf_shards', 'one.safetensors'):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        checkpoint = s.load_checkpoint(str(made / name))
        assert torch.equal(_logits(model), trained), name
        assert len(checkpoint['state_dict']) == 21
        assert checkpoint['meta']['iter'] == STEPS  # the step convert recorded
    pretrained = torch.load(made / 'pretrained_logits.pt')
    for name in ('pretrained', 'pretrained_one'):  # save_pretrained's: shards, one file
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        s.load_checkpoint(str(made / name))
        assert torch.equal(_logits(model), pretrained), name
    assert sorted(p.name for p in (made / 'pretrained_one').iterdir()) == [
        'config.json',
        'generation_config.json',
        'model.safetensors',
    ]


def test_missing_and_unexpected_names_reported(made, tmp_path, caplog):
    from stratagem.checkpoint import StateDictMismatchError
    from stratagem.strategies import SingleDeviceStrategy

    s = SingleDeviceStrategy(work_dir=str(tmp_path))
    model = s.prepare(_llama(seed=7))
    head = model.lm_head.weight.detach().clone()
    with pytest.raises(StateDictMismatchError, match='partial') as err:
        s.load_checkpoint(str(made / 'partial'), strict=True)
    assert 'lm_head.weight' in str(err.value) and 'extra.w' in str(err.value)
    with caplog.at_level('WARNING'):
        s.load_checkpoint(str(made / 'partial'))
    assert 'lm_head.weight' in caplog.text and 'extra.w' in caplog.text
    assert torch.equal(model.lm_head.weight, head)  # what the file lacks is left as it was
    trained = read_hf(made / 'hf')['state_dict']
    assert torch.equal(model.model.norm.weight, trained['model.norm.weight'])


def test_hf_back_to_a_stratagem_file_and_keys_cleaned(made, tmp_path):
    from stratagem.checkpoint import load_checkpoint_file
    from stratagem.checkpoint.huggingface import read_safetensors, save_hf_directory
    from stratagem.cli import main

    # an HF directory is a source like any other: its config travels on
    assert main(['convert', str(made / 'pretrained'), str(tmp_path / 'back.pth')]) == 0
    back = load_checkpoint_file(tmp_path / 'back.pth')
    assert len(back['state_dict']) == 21
    assert json.loads(back['meta']['hf_config'])['model_type'] == 'llama'
    # wrappers' prefixes go; tied (shared) tensors are written apart
    w = torch.arange(6.0).reshape(2, 3)
    weights = {'module.a._checkpoint_wrapped_module.w': w, 'module._orig_mod.b': w, 'n': 3}
    with pytest.warns(UserWarning, match='no config.json was written'):
        out = save_hf_directory(weights, tmp_path / 'plain')
    tensors, metadata = read_safetensors(out / 'model.safetensors')
    assert sorted(tensors) == ['a.w', 'b'] and metadata == {'format': 'pt'}
    assert torch.equal(tensors['a.w'], w) and torch.equal(tensors['b'], w)


def test_damaged_or_missing_files_are_named(made, tmp_path, capsys):
    from stratagem.checkpoint import CheckpointCorruptError
    from stratagem.cli import main
    from stratagem.strategies import SingleDeviceStrategy

    s = SingleDeviceStrategy(work_dir=str(tmp_path / 'run'))
    s.prepare(_llama(seed=7))
    # a directory without our manifest (as save_pretrained writes it), one shard truncated
    foreign = tmp_path / 'foreign'
    shutil.copytree(made / 'pretrained', foreign)
    shard = foreign / 'model-00002-of-00003.safetensors'
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointCorruptError, match=f'{shard}: not a readable safetensors'):
        s.load_checkpoint(str(foreign))
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=r"\['model-00002-of-00003.safetensors'\]"):
        s.load_checkpoint(str(foreign))
    # ours: the manifest names the damaged file before the library reads it
    ours = tmp_path / 'ours'
    shutil.copytree(made / 'hf', ours)
    data = bytearray((ours / 'model.safetensors').read_bytes())
    data[-5] ^= 0xFF
    (ours / 'model.safetensors').write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match='model.safetensors'):
        s.load_checkpoint(str(ours))
    # a foreign file by that suffix, through the command line
    junk = tmp_path / 'junk.safetensors'
    junk.write_bytes(b'\x08\x00\x00\x00\x00\x00\x00\x00not json')
    assert main(['convert', str(junk), str(tmp_path / 'x'), '--to', 'hf']) == 1
    assert f'{junk}: not a readable safetensors file' in capsys.readouterr().err
    assert main(['convert', str(made / 'hf'), str(tmp_path / 'y'), '--max-shard-size', '1GB']) == 1
    assert "it needs to='hf' (--to hf), not 'file'" in capsys.readouterr().err
    assert not (tmp_path / 'x').exists() and not (tmp_path / 'y').exists()


def test_without_safetensors_the_extra_is_named(made, monkeypatch, tmp_path):
    from stratagem.checkpoint.huggingface import read_safetensors

    monkeypatch.setitem(sys.modules, 'safetensors', None)
    with pytest.raises(ImportError, match=r'pip install "stratagem\[hf\]"'):
        read_safetensors(made / 'one.safetensors')


@pytest.mark.parametrize(
    'size, expected',
    [('5GB', 5 * 10**9), ('500MB', 5 * 10**8), ('2GiB', 2 * 2**30), ('20kb', 20_000), (64, 64)],
)
def test_parse_size(size, expected):
    from stratagem.checkpoint.huggingface import parse_size

    assert parse_size(size) == expected


def test_parse_size_refuses(tmp_path):
    from stratagem.checkpoint.huggingface import parse_size

    with pytest.raises(ValueError, match="'5 parsecs' is not a size"):
        parse_size('5 parsecs')
    with pytest.raises(ValueError, match='must be positive'):
        parse_size('0MB')


# ------------------------------------------------------------------------ 2 gloo ranks
@SCENARIOS.add('two')
def fsdp(tmp):
    """Load each directory into an FSDP model of another seed: logits, and the share of
    every tensor this rank read. Then train a few steps and save sharded (DCP), for the
    test process to convert to hf."""
    from torch.distributed.tensor import DTensor

    from stratagem.strategies import build_strategy

    _quiet()
    tmp = Path(tmp)
    s = build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=str(tmp / 'fsdp'),
            model_wrapper=dict(auto_wrap_policy=['LlamaDecoderLayer']),
            env_kwargs=dict(randomness=dict(seed=3)),
        )
    )
    model, ow = s.prepare(_llama(seed=7), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)))
    out = {'before': _logits(model)}
    for name in ('hf', 'hf_shards', 'pretrained', 'one.safetensors'):
        read = {}

        def seen(checkpoint, read=read):
            for key, t in checkpoint['state_dict'].items():
                read[key] = (
                    isinstance(t, DTensor),
                    (t.to_local() if isinstance(t, DTensor) else t).numel(),
                )

        s.load_checkpoint(str(tmp / name), callback=seen)
        out[name] = _logits(model)
        out[f'{name}_read'] = read
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    s.logger.addHandler(handler)
    s.load_checkpoint(str(tmp / 'partial'))
    s.logger.removeHandler(handler)
    out['partial_report'] = [r.getMessage() for r in records]
    ids = _ids()
    for _ in range(2):
        ow.update_params(model(input_ids=ids, labels=ids).loss)
    out['saved'] = s.save_checkpoint(str(tmp / 'fsdp_iter_2'), extra_ckpt={'meta': {'iter': 2}})
    out['trained'] = _logits(model)
    return out


@pytest.mark.scenario('fsdp')
def test_fsdp_loads_hf_each_rank_its_pieces(scenario, made):
    trained = torch.load(made / 'trained_logits.pt')
    pretrained = torch.load(made / 'pretrained_logits.pt')
    total = {k: v.numel() for k, v in _llama(0).state_dict().items()}
    for r in scenario:
        assert not torch.allclose(r['before'], trained)
        for name in ('hf', 'hf_shards', 'one.safetensors'):
            assert (r[name] - trained).abs().max() <= 1e-12, name
        assert (r['pretrained'] - pretrained).abs().max() <= 1e-12
    for name in ('hf', 'hf_shards', 'pretrained', 'one.safetensors'):
        reads = [r[f'{name}_read'] for r in scenario]
        assert reads[0].keys() == total.keys()
        for key, n in total.items():  # every sharded tensor read half by each rank
            assert all(read[key][0] for read in reads), (name, key)
            assert [read[key][1] for read in reads] == [n // 2, n // 2], (name, key)


@pytest.mark.scenario('fsdp')
def test_fsdp_reports_missing_and_unexpected_names(scenario):
    report = scenario[0]['partial_report']
    assert len(report) == 1 and "['lm_head.weight']" in report[0] and "['extra.w']" in report[0]
    assert scenario[1]['partial_report'] == []  # said once, by rank 0


@pytest.mark.scenario('fsdp')
def test_fsdp_sharded_checkpoint_to_hf(scenario, tmp_path):
    from transformers import AutoModelForCausalLM

    from stratagem.cli import main

    saved = scenario[0]['saved']
    assert main(['convert', saved, str(tmp_path / 'hf'), '--to', 'hf']) == 0
    config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
    assert config['architectures'] == ['LlamaForCausalLM']  # not FSDP2's FSDPLlamaForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'hf'))
    assert (_logits(model) - scenario[0]['trained']).abs().max() <= 1e-12
