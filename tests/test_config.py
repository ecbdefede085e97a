"""Config: strict ConfigDict, files with _base_, overrides, dump round trips, error texts."""

import copy
import json
import pickle

import pytest

from stratagem.config import Config, ConfigDict, ConfigError, merge_dicts, parse_cfg_options


def test_configdict_strict_reads():
    cfg = ConfigDict(model=dict(type='MLP', depth=2), layers=[dict(a=1)])
    assert cfg.model.depth == 2 and cfg['model']['type'] == 'MLP'
    assert isinstance(cfg.layers[0], ConfigDict) and cfg.layers[0].a == 1
    with pytest.raises(AttributeError, match="config has no key 'modle'; keys here: 'model'"):
        cfg.modle  # noqa: B018
    with pytest.raises(KeyError, match="config has no key 'x'"):
        cfg['x']
    assert not hasattr(cfg, 'x')
    assert 'x' not in cfg  # reading did not create it
    assert cfg.get('x', 7) == 7 and 'x' not in cfg
    cfg.new = dict(b=2)
    assert isinstance(cfg.new, ConfigDict) and cfg.new.b == 2


def test_configdict_copy_pickle_and_plain():
    cfg = ConfigDict(a=dict(b=[1, 2]))
    deep = copy.deepcopy(cfg)
    deep.a.b.append(3)
    assert cfg.a.b == [1, 2]
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    plain = cfg.to_dict()
    assert type(plain) is dict and type(plain['a']) is dict and plain == {'a': {'b': [1, 2]}}
    with pytest.raises(KeyError, match="no key 'zz'"):
        cfg.pop('zz')


def test_merge_and_delete():
    base = {'a': {'x': 1, 'y': 2}, 'b': 1}
    out = merge_dicts(base, {'a': {'y': 3, 'z': 4}, 'c': 5})
    assert out == {'a': {'x': 1, 'y': 3, 'z': 4}, 'b': 1, 'c': 5}
    out = merge_dicts(base, {'a': {'_delete_': True, 'q': 0}})
    assert out == {'a': {'q': 0}, 'b': 1}
    assert base == {'a': {'x': 1, 'y': 2}, 'b': 1}


def _write(path, text):
    path.write_text(text)
    return path


def test_fromfile_py_with_bases(tmp_path):
    _write(tmp_path / 'base_model.py', "model = dict(type='MLP', depth=2, width=8)\n")
    _write(tmp_path / 'base_optim.yaml', 'optim_wrapper:\n  optimizer: {type: SGD, lr: 0.1}\n')
    cfg_path = _write(
        tmp_path / 'exp.py',
        (
            "_base_ = ['base_model.py', 'base_optim.yaml']\n"
            'import math\n'
            'model = dict(depth=4)\n'
            "optim_wrapper = dict(optimizer=dict(_delete_=True, type='AdamW',\n"
            '                                    lr=math.sqrt(4) / 1e3))\n'
            'def helper():\n    return 1\n'
        ),
    )
    cfg = Config.fromfile(cfg_path)
    assert cfg.model == {'type': 'MLP', 'depth': 4, 'width': 8}
    assert cfg.optim_wrapper.optimizer == {'type': 'AdamW', 'lr': 0.002}
    assert 'math' not in cfg and 'helper' not in cfg and '_base_' not in cfg
    assert cfg.filename == str(cfg_path)


def test_fromfile_json_single_base_string(tmp_path):
    _write(tmp_path / 'base.json', json.dumps({'a': {'b': 1, 'c': 2}}))
    path = _write(tmp_path / 'cfg.json', json.dumps({'_base_': 'base.json', 'a': {'c': 3}}))
    assert Config.fromfile(path).to_dict() == {'a': {'b': 1, 'c': 3}}


def test_base_key_defined_twice_is_an_error(tmp_path):
    _write(tmp_path / 'a.py', 'x = 1\n')
    _write(tmp_path / 'b.py', 'x = 2\n')
    path = _write(tmp_path / 'c.py', "_base_ = ['a.py', 'b.py']\n")
    with pytest.raises(ConfigError, match=r"keys \['x'\] are defined in more than one _base_"):
        Config.fromfile(path)


def test_circular_base(tmp_path):
    _write(tmp_path / 'a.py', "_base_ = 'b.py'\n")
    _write(tmp_path / 'b.py', "_base_ = 'a.py'\n")
    with pytest.raises(ConfigError, match='circular _base_'):
        Config.fromfile(tmp_path / 'a.py')


def test_bad_files_name_path_and_line(tmp_path):
    bad_py = _write(tmp_path / 'bad.py', 'a = 1\nb = (\n')
    with pytest.raises(ConfigError) as info:
        Config.fromfile(bad_py)
    assert f'{bad_py}:' in str(info.value) and 'syntax error' in str(info.value)
    raising = _write(tmp_path / 'raise.py', 'a = 1\nb = 1 / 0\n')
    with pytest.raises(
        ConfigError,
        match=r'raise.py:2: error while executing config: '
        r'ZeroDivisionError',
    ):
        Config.fromfile(raising)
    bad_json = _write(tmp_path / 'bad.json', '{"a": 1,\n "b": }')
    with pytest.raises(ConfigError, match=r'bad.json:2:7: invalid JSON'):
        Config.fromfile(bad_json)
    bad_yaml = _write(tmp_path / 'bad.yaml', 'a: [1, 2\nb: 3\n')
    with pytest.raises(ConfigError, match=r'bad.yaml:\d+:\d+: invalid YAML'):
        Config.fromfile(bad_yaml)
    toml = _write(tmp_path / 'cfg.toml', 'a = 1\n')
    with pytest.raises(
        ConfigError,
        match=r"cfg.toml: unsupported config extension '.toml'; "
        r'use one of .py, .json, .yaml, .yml',
    ):
        Config.fromfile(toml)
    with pytest.raises(FileNotFoundError, match='config file not found: .*missing.py'):
        Config.fromfile(tmp_path / 'missing.py')
    listy = _write(tmp_path / 'list.yaml', '- 1\n- 2\n')
    with pytest.raises(ConfigError, match='must hold a mapping'):
        Config.fromfile(listy)


def test_cfg_options_parser_and_merge_from_dict():
    opts = parse_cfg_options(
        [
            'a.b=1',
            'c=[1,2]',
            'd=xyz',
            'e=true',
            'f=None',
            'g=0.5',
            'h=1,2',
            'i=(3, 4)',
            "j={'k': 1}",
        ]
    )
    assert opts == {
        'a.b': 1,
        'c': [1, 2],
        'd': 'xyz',
        'e': True,
        'f': None,
        'g': 0.5,
        'h': [1, 2],
        'i': (3, 4),
        'j': {'k': 1},
    }
    assert parse_cfg_options(['a=[cat,dog]', 'b=[x,[1,y]]', 'c=(u,2)']) == {
        'a': ['cat', 'dog'],
        'b': ['x', [1, 'y']],
        'c': ('u', 2),
    }
    with pytest.raises(ConfigError, match="bad --cfg-options item 'novalue'"):
        parse_cfg_options(['novalue'])
    cfg = Config({'a': {'b': 0, 'keep': 1}, 'sched': [{'lr': 1}, {'lr': 2}]})
    cfg.merge_from_dict({'a.b': 5, 'sched.1.lr': 9, 'new.deep.key': 'x'})
    assert cfg.a == {'b': 5, 'keep': 1}
    assert cfg.sched[1].lr == 9 and cfg.new.deep.key == 'x'
    with pytest.raises(ConfigError, match='index 5 is out of range for a list of length 2'):
        cfg.merge_from_dict({'sched.5.lr': 1})
    with pytest.raises(ConfigError, match="'a.b' is a int, not a dict"):
        cfg.merge_from_dict({'a.b.c': 1})


@pytest.mark.parametrize('suffix', ['.py', '.json', '.yaml'])
def test_dump_round_trip(tmp_path, suffix):
    cfg = Config(
        {
            'model': {'type': 'MLP', 'dims': [1, 2], 'flag': True, 'none': None},
            'lr': 0.1,
            'name': "it's",
        }
    )
    out = tmp_path / f'dumped{suffix}'
    cfg.dump(out)
    assert Config.fromfile(out).to_dict() == cfg.to_dict()


def test_dump_rejects_non_literals(tmp_path):
    cfg = Config({'optimizer': {'type': dict}})
    with pytest.raises(ConfigError, match="cannot dump config key 'optimizer.type'"):
        cfg.dump(tmp_path / 'x.py')


def test_repr_is_readable(tmp_path):
    cfg = Config({'a': {'b': 1}}, filename='x.py')
    text = repr(cfg)
    assert text.startswith('Config (path: x.py):') and "a = {'b': 1}" in text


# ---- numbers given as strings (#15): converted with a warning naming the key, else refused
def test_yaml_exponent_numbers_are_converted_naming_the_key(tmp_path):
    import yaml

    from stratagem.config import ConfigWarning

    path = tmp_path / 'cfg.yaml'
    path.write_text(
        'model: {type: Net, eps: 1e-5}\n'
        'optim_wrapper:\n  optimizer: {type: AdamW, lr: 1e-3, betas: [0.9, "0.999"],'
        ' eps: 1e-8}\n  clip_grad: {max_norm: "5"}\n'
        '  paramwise_cfg: {custom_keys: {head: {lr_mult: "10"}}}\n'
        'param_scheduler: [{type: MultiStepLR, milestones: ["3", 6], gamma: .1}]\n'
        'train_cfg: {max_iters: 1e3}\n'
        'train_dataloader: {batch_size: "8", dataset: {type: D, size: "7"}}\n'
    )
    assert yaml.safe_load(path.read_text())['optim_wrapper']['optimizer']['lr'] == '1e-3'
    with pytest.warns(ConfigWarning) as record:
        cfg = Config.fromfile(path)
    (warning,) = record
    text = str(warning.message)
    for key in (
        "optim_wrapper.optimizer.lr='1e-3'",
        "optim_wrapper.optimizer.betas.1='0.999'",
        "optim_wrapper.optimizer.eps='1e-8'",
        "optim_wrapper.clip_grad.max_norm='5'",
        'paramwise_cfg.custom_keys.head.lr_mult',
        "param_scheduler.0.milestones.0='3'",
        "train_cfg.max_iters='1e3'",
        "train_dataloader.batch_size='8'",
        str(path),
        '1.0e-3, not 1e-3',
    ):
        assert key in text, key
    opt = cfg.optim_wrapper.optimizer
    assert (opt.lr, opt.betas, opt.eps) == (0.001, [0.9, 0.999], 1e-8)
    assert cfg.optim_wrapper.clip_grad.max_norm == 5
    assert cfg.optim_wrapper.paramwise_cfg.custom_keys.head.lr_mult == 10
    assert cfg.param_scheduler[0].milestones == [3, 6]
    assert type(cfg.train_cfg.max_iters) is int and cfg.train_cfg.max_iters == 1000
    assert cfg.train_dataloader.batch_size == 8
    # a model's and a dataset's own arguments are the user's: left as they are
    assert cfg.model.eps == '1e-5' and cfg.train_dataloader.dataset.size == '7'


def test_a_string_that_is_not_a_number_is_refused_naming_the_key(tmp_path):
    path = tmp_path / 'cfg.json'
    path.write_text(json.dumps({'optim_wrapper': {'optimizer': {'type': 'SGD', 'lr': 'fast'}}}))
    with pytest.raises(
        ConfigError,
        match=r"optim_wrapper\.optimizer\.lr='fast' in "
        rf'{path}.* must be a number \(e\.g\. lr=0\.01\)',
    ):
        Config.fromfile(path)
    # words some numeric settings accept stay words
    cfg = Config(dict(optim_wrapper=dict(loss_scale='dynamic'), randomness=dict(seed=None)))
    assert cfg.optim_wrapper.loss_scale == 'dynamic' and cfg.randomness.seed is None


def test_bad_override_changes_nothing_and_typos_warn():
    from stratagem.config import ConfigWarning

    cfg = Config(dict(optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))))
    before = copy.deepcopy(cfg.to_dict())
    with pytest.raises(
        ConfigError,
        match=r"optim_wrapper\.optimizer\.momentum='fast' in the "
        'overrides must be a number',
    ):
        cfg.merge_from_dict(
            parse_cfg_options(
                ['optim_wrapper.optimizer.lr=0.5', 'optim_wrapper.optimizer.momentum=fast']
            )
        )
    assert cfg.to_dict() == before  # the good override before the bad one was not applied
    with pytest.warns(ConfigWarning) as record:
        cfg.merge_from_dict(
            {
                'lr': 0.5,
                'optim_wrapper.optimizer.mometum': 0.5,
                'optim_wrapper.clip_grad.max_norm': 1.0,
            }
        )
    texts = [str(w.message) for w in record]
    assert len(texts) == 2  # adding clip_grad is not a typo: no warning
    assert "override 'lr' adds a key" in texts[0]
    assert "did you mean 'optim_wrapper.optimizer.lr'?" in texts[0]
    assert "did you mean 'optim_wrapper.optimizer.momentum'?" in texts[1]


def test_config_errors_name_the_file(tmp_path):
    (tmp_path / 'a.yaml').write_text('x: 1\n')
    with pytest.raises(
        ConfigError,
        match=rf'{tmp_path} is a directory, not a config file; '
        rf'.*e\.g\. {tmp_path / "a.yaml"}',
    ):
        Config.fromfile(tmp_path)
    from stratagem.config import ConfigAttributeError

    with pytest.raises(ConfigAttributeError, match="no key 'optim_wrappr'"):
        Config(dict(optim_wrapper={})).optim_wrappr  # noqa: B018


def test_cfg_options_dict_call_reads_as_a_dict():
    opts = parse_cfg_options(
        ["a=dict(type='norm', max_norm=5.0)", 'b=dict(x=dict(y=[1,2]))', 'c=f(1,2)', 'd=1,2']
    )
    assert opts == {
        'a': {'type': 'norm', 'max_norm': 5.0},
        'b': {'x': {'y': [1, 2]}},
        'c': 'f(1,2)',  # not a dict(...) of literals: a string, as before (no recursion)
        'd': [1, 2],
    }


def test_check_overrides_refuses_keys_that_would_change_nothing():
    from stratagem.config.overrides import check_overrides

    cfg = Config(
        dict(
            model=dict(type='MLPClassifier', hidden=8),
            param_scheduler=[dict(type='LinearLR'), dict(type='CosineAnnealingLR', end=4)],
            optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05)),
            train_cfg=dict(max_epochs=2),
            train_dataloader=dict(batch_size=4, dataset=dict(type='D', num_samples=8)),
        )
    )
    # the config's keys, keys the schema documents, new arguments of a built object: fine
    for ok in (
        'optim_wrapper.optimizer.lr',
        'train_cfg.preemption',
        'train_cfg.preemption.exit_code',
        'randomness.seed',
        'strategy.env_kwargs.launcher',
        'model.dropout',
        'optim_wrapper.clip_grad',
        'param_scheduler.0.end',  # the other scheduler's end is no typo of it
    ):
        check_overrides(cfg, {ok: 1})
    refused = {
        'lr': "unknown key 'lr' in --cfg-options: the config has no such key, so setting it "
        "would change nothing; did you mean 'optim_wrapper.optimizer.lr'?",
        'optim_wrapper.optimizer.lrr': "did you mean 'optim_wrapper.optimizer.lr'?",
        'train_cfg.max_epoch': "train_cfg has no 'max_epoch'; did you mean "
        "'train_cfg.max_epochs'? valid keys of train_cfg: anomaly, by_epoch,",
        'train_dataloader.num_worker': "did you mean 'train_dataloader.num_workers'?",
        'train_cfg.foo.bar': "train_cfg has no 'foo'; valid keys of train_cfg:",
        'optim_wrapper.optimzer.lr': "did you mean 'optim_wrapper.optimizer'?",
    }
    for key, said in refused.items():
        with pytest.raises(ConfigError) as info:
            check_overrides(cfg, {key: 1})
        assert said in str(info.value), key
