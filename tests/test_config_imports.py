"""``custom_imports`` and dotted ``type`` paths (``stratagem.config.imports``,
``stratagem.registry.import_dotted``): the user's own code builds by name, from the config's
directory and the working directory; a failed import names the module."""

import sys
import textwrap
import uuid

import pytest
import torch

from stratagem.config import Config, ConfigError, import_custom_modules
from stratagem.registry import MODELS, OPTIMIZERS, RegistryError, import_dotted


@pytest.fixture
def isolated_path(monkeypatch):
    """sys.path and sys.modules as they were after the test; a unique package name."""
    monkeypatch.setattr(sys, 'path', list(sys.path))
    name = f'userpkg_{uuid.uuid4().hex[:8]}'
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(f'{name}.')]:
        del sys.modules[mod]  # only the test's own: torch's lazily imported modules stay


def write_package(root, name, model_body='', extra=''):
    pkg = root / name
    pkg.mkdir()
    (pkg / '__init__.py').write_text(
        textwrap.dedent(f"""
        import torch
        from stratagem.registry import MODELS
        {extra}

        @MODELS.register_module(name='{name}_Net')
        class Net(torch.nn.Module):
            def __init__(self, width=3):
                super().__init__()
                self.fc = torch.nn.Linear(width, 2)
            {model_body}
        """)
    )
    return pkg


def write_config(path, name, **extra):
    lines = [f'custom_imports = dict(imports=[{name!r}])', f"model = dict(type='{name}_Net')"]
    lines += [f'{k} = {v!r}' for k, v in extra.items()]
    path.write_text('\n'.join(lines) + '\n')
    return path


def test_package_beside_the_config_is_imported_and_builds_by_name(tmp_path, isolated_path):
    name = isolated_path
    write_package(tmp_path, name)
    cfg = Config.fromfile(write_config(tmp_path / 'cfg.py', name))
    model = MODELS.build(dict(cfg.model, width=5))
    assert type(model).__module__ == name
    assert model.fc.in_features == 5
    assert str(tmp_path) in sys.path


def test_package_in_the_working_directory_is_found(tmp_path, isolated_path, monkeypatch):
    name = isolated_path
    (tmp_path / 'cwd').mkdir()
    (tmp_path / 'cfgs').mkdir()
    write_package(tmp_path / 'cwd', name)
    monkeypatch.chdir(tmp_path / 'cwd')
    Config.fromfile(write_config(tmp_path / 'cfgs' / 'cfg.py', name))
    assert MODELS.get(f'{name}_Net').__module__ == name


def test_a_missing_module_is_an_error_naming_it_and_where_it_looked(tmp_path, isolated_path):
    cfg = tmp_path / 'cfg.py'
    cfg.write_text("custom_imports = dict(imports=['no_such_module_xyz'])\n")
    with pytest.raises(ConfigError) as err:
        Config.fromfile(cfg)
    message = str(err.value)
    assert "cannot import 'no_such_module_xyz'" in message
    assert str(tmp_path) in message  # the config's directory was searched


def test_a_module_whose_own_import_fails_is_named_with_its_error(tmp_path, isolated_path):
    name = isolated_path
    write_package(tmp_path, name, extra='import numpy_that_is_not_there')
    with pytest.raises(ConfigError) as err:
        Config.fromfile(write_config(tmp_path / 'cfg.py', name))
    message = str(err.value)
    assert f'importing {name!r} failed in its own code' in message
    assert 'numpy_that_is_not_there' in message
    assert '__init__.py:' in message  # the line that raised


def test_allow_failed_imports_warns_and_goes_on(tmp_path, isolated_path):
    with pytest.warns(UserWarning, match="'nope_xyz'.*allow_failed_imports=True"):
        mods = import_custom_modules(
            dict(imports=['nope_xyz', 'json'], allow_failed_imports=True), [tmp_path]
        )
    assert [m.__name__ for m in mods] == ['json']


@pytest.mark.parametrize(
    'bad, words',
    [
        ('json', 'must be a dict'),
        (dict(imports=['json'], allow_failed=True), "unknown key(s) ['allow_failed']"),
        (dict(imports=[3]), 'list of module names'),
        (dict(imports=['json'], allow_failed_imports='yes'), 'True or False'),
    ],
)
def test_malformed_custom_imports_are_named(bad, words):
    with pytest.raises(ConfigError) as err:
        import_custom_modules(bad)
    assert words in str(err.value)


def test_no_import_without_the_flag(tmp_path, isolated_path):
    cfg = tmp_path / 'cfg.py'
    cfg.write_text("custom_imports = dict(imports=['no_such_module_xyz'])\n")
    assert Config.fromfile(cfg, import_custom_modules=False).custom_imports.imports == [
        'no_such_module_xyz'
    ]


def test_dotted_type_builds_in_every_registry_without_registration(tmp_path, isolated_path):
    name = isolated_path
    write_package(tmp_path, name)
    cfg = tmp_path / 'cfg.py'
    cfg.write_text(f"model = dict(type='{name}.Net', width=4)\n")
    model = MODELS.build(Config.fromfile(cfg).model)  # the config's directory is searched
    assert model.fc.in_features == 4
    sgd = OPTIMIZERS.build(dict(type='torch.optim.SGD', params=model.parameters(), lr=0.5))
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]['lr'] == 0.5
    assert import_dotted('torch.nn.Linear') is torch.nn.Linear


def test_dotted_type_errors_name_the_module(tmp_path, isolated_path, monkeypatch):
    name = isolated_path
    with pytest.raises(RegistryError) as err:
        MODELS.build(dict(type='no_such_pkg_xyz.models.Net'))
    assert "no module 'no_such_pkg_xyz' on the import path" in str(err.value)
    assert "registry ('model')" not in str(err.value)
    assert 'registered names: ' in str(err.value)
    with pytest.raises(ImportError, match=r"'torch\.nn' has no attribute 'NoSuchLayer'"):
        MODELS.build(dict(type='torch.nn.NoSuchLayer'))
    write_package(tmp_path, name, extra='raise RuntimeError("broken on purpose")')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=rf"importing module '{name}' failed in its own code"):
        MODELS.build(dict(type=f'{name}.Net'))
