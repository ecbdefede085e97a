"""Every private torch API stratagem uses (``stratagem/_torch.py``) still behaves as the package
relies on, against the installed torch: a torch upgrade that breaks one fails here, by name."""

import io
import pickletools
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stratagem import _torch


@pytest.fixture
def single_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / 'store'), 1)
    dist.init_process_group('gloo', store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_norm_base_classes():
    for bn in (nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.SyncBatchNorm(3)):
        assert isinstance(bn, _torch.BatchNormBase)
    assert isinstance(nn.InstanceNorm2d(3), _torch.InstanceNormBase)
    assert not isinstance(nn.LayerNorm(3), (_torch.BatchNormBase, _torch.InstanceNormBase))


def test_module_state():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[0].register_buffer('scratch', torch.zeros(1), persistent=False)
    model.register_buffer('top', torch.zeros(1), persistent=False)
    assert sorted(_torch.non_persistent_buffers(model)) == ['0.scratch', 'top']

    sd = model.state_dict()
    metadata = _torch.state_dict_metadata(sd)
    assert metadata['1']['version'] == 2  # BatchNorm's version, as load_state_dict reads it
    assert _torch.state_dict_metadata({}) is None
    plain = OrderedDict(sd)  # what revise_keys builds
    _torch.set_state_dict_metadata(plain, metadata)
    assert _torch.state_dict_metadata(plain) is metadata

    compiled = torch.compile(model)  # wraps only; nothing compiles before a call
    assert _torch.compiled_inner(compiled) is model
    assert _torch.compiled_inner(model) is None
    named = [n for n, _ in compiled.named_parameters()]
    assert all(n.startswith(_torch.WRAPPER_PREFIXES[1]) for n in named)


def test_foreach_and_amp_kernels():
    ts = [torch.ones(2), torch.full((3,), 2.0)]
    _torch.foreach_mul_(ts, torch.tensor(0.5))
    assert ts[0].tolist() == [0.5, 0.5] and ts[1].tolist() == [1.0] * 3

    grads = [torch.full((2,), 4.0), torch.tensor([1.0, float('inf')])]
    found = torch.zeros(1)
    _torch.unscale_and_check_(grads[:1], found, torch.full((1,), 0.25))
    assert grads[0].tolist() == [1.0, 1.0] and found.item() == 0
    _torch.unscale_and_check_(grads[1:], found, torch.full((1,), 0.25))
    assert found.item() == 1


def test_grad_scaler_found_inf():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler('cpu')
    assert _torch.grad_scaler_found_inf(scaler, optimizer) == []
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(optimizer)
    found = _torch.grad_scaler_found_inf(scaler, optimizer)
    assert len(found) == 1 and found[0].item() == 0
    scaler.update()


def test_serialization_names():
    buffer = io.BytesIO()
    torch.save(torch.arange(3, dtype=torch.float32), buffer)
    blob = buffer.getvalue()
    reader = _torch.zip_archive_reader(io.BytesIO(blob))
    records = reader.get_all_records()
    assert 'data.pkl' in records and 'data/0' in records
    globals_ = [
        arg.split(' ')
        for op, arg, _ in pickletools.genops(reader.get_record('data.pkl'))
        if op.name == 'GLOBAL'
    ]
    assert list(_torch.REBUILD_TENSOR) in globals_
    assert ['torch', 'FloatStorage'] in globals_
    dtypes = _torch.storage_dtypes()
    assert dtypes['FloatStorage'] is torch.float32 and dtypes['BFloat16Storage'] is torch.bfloat16
    assert not any(name.startswith('Q') for name in dtypes)
    assert zipfile.is_zipfile(io.BytesIO(blob))


def test_activation_checkpointing_and_fsdp1_policies():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    first, last = model[0], model[2]
    _torch.apply_activation_checkpointing(model, lambda m: m is first)
    assert _torch.checkpoint_wrapped(model[0]) is first
    assert _torch.checkpoint_wrapped(model[2]) is None
    assert any(n.startswith('0.' + _torch.WRAPPER_PREFIXES[0]) for n, _ in model.named_parameters())

    policy = ModuleWrapPolicy({nn.Linear})
    assert isinstance(policy, _torch.fsdp1_policy_type())
    chosen = _torch.run_fsdp1_policy(policy, model, set())
    assert first in chosen and last in chosen


def test_fake_tensors_pytree_and_memory_tracker():
    with torch.device('meta'):
        model = nn.Linear(4, 4)
    with _torch.fake_tensor_mode():
        model.to_empty(device='cpu')
        assert type(model.weight.data).__name__ == 'FakeTensor'
    assert _torch.tree_map(lambda x: x * 2, {'a': (1, [2])}) == {'a': (2, [4])}

    model = nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    with _torch.memory_tracker(model, [optimizer], fsdp=False) as tracker:
        model(torch.ones(8, 64)).sum().backward()
        optimizer.step()
    peak = tracker.get_tracker_snapshot('peak')  # {device: {category: bytes}}, as doctor reads it
    totals = {str(getattr(k, 'value', k)): v for stats in peak.values() for k, v in stats.items()}
    assert totals['Total'] >= 64 * 64 * 4 * 4  # weights, gradients, Adam's two moments


def test_distributed_private_apis(single_rank_group, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    store = _torch.default_store()
    store.set('compat', 'yes')
    assert store.get('compat') == b'yes'

    mesh = init_device_mesh('cpu', (1,))
    dt = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    copy = _torch.dtensor_like(dt, dt.to_local().clone())
    assert copy.placements == dt.placements and copy.shape == dt.shape
    assert not copy.requires_grad and copy.to_local().tolist() == [0.0, 1.0, 2.0, 3.0]
    plain = torch.ones(3)
    assert _torch.local_shard(dt).data_ptr() == dt.to_local().data_ptr()
    assert _torch.local_shard(plain) is plain

    model = nn.Linear(2, 2)
    fully_shard(model, mesh=mesh)
    params = _torch.fsdp_params(model)
    assert {id(fp.sharded_param) for fp in params} == {id(p) for p in model.parameters()}
    assert _torch.fsdp_params(nn.Linear(2, 2)) == []
    model.unshard()
    assert all(isinstance(_torch.unsharded_param(fp), torch.Tensor) for fp in params)
    model.reshard()

    dcp.save({'w': torch.ones(2), 'n': 3}, checkpoint_id=tmp_path / 'ck')
    whole = _torch.load_whole_dcp(dcp.FileSystemReader(tmp_path / 'ck'))
    assert whole['w'].tolist() == [1.0, 1.0] and whole['n'] == 3


def test_installed_torch_is_the_supported_release():
    tomllib = pytest.importorskip('tomllib')  # Python >= 3.11
    from packaging.requirements import Requirement
    from packaging.version import Version

    pyproject = tomllib.loads((Path(__file__).parents[1] / 'pyproject.toml').read_text())
    (spec,) = [
        Requirement(r).specifier
        for r in pyproject['project']['dependencies']
        if Requirement(r).name == 'torch'
    ]
    installed = Version(torch.__version__).base_version  # '2.13.0+cpu' -> '2.13.0'
    assert spec.contains(installed), (
        f'torch {torch.__version__} is outside pyproject.toml torch{spec}, the release '
        'stratagem/_torch.py is written for'
    )
