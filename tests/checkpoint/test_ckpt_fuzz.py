"""Damaged checkpoints get named errors (issue #32): a seeded, derandomized Hypothesis run
over (layout, mutation, file, offset, length, value, entry point) on copies of the frozen
checkpoints in ``tests/data/legacy/``, fixed cases for each mutation and the absurd claims,
and the safetensors library (behind our reader, ``checkpoint/huggingface.py``) fed junk
headers. The slow tier soaks the same property over 1,500 examples; the long run is
``benchmarks/checkpoint_fuzz.py``.

Every load either gives the original weights or raises one of our documented errors naming
the checkpoint (``ckpt_fuzz_cases.run_case``). A ``*_resigned`` mutation also rewrites the
manifest to match the damaged bytes, so that they reach the parsers: there other weights are
the expected outcome of a changed tensor byte (nothing can tell), but no raw exception is.
"""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt_fuzz_cases as F
from scenarios import Scenarios
from stratagem.checkpoint.errors import CheckpointCorruptError
from stratagem.checkpoint.huggingface import read_safetensors, save_safetensors_file

NO_DEEPSPEED = 'DeepSpeed is an optional extra (stratagem[deepspeed])'


def _deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


LAYOUTS = F.LAYOUTS if _deepspeed() else ('single', 'fsdp')
FUZZ = settings(
    derandomize=True,
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


def _ok(outcome: str, detail: str, mutation: str) -> None:
    if outcome == 'other weights' and mutation.endswith('_resigned'):
        return  # a changed tensor byte under a re-signed manifest: undetectable by design
    assert outcome in ('exact', 'named'), f'{outcome}: {detail}'


@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple, str]:
    layout = draw(st.sampled_from(LAYOUTS))
    mutation = draw(st.sampled_from(F.MUTATIONS))
    target = draw(st.sampled_from(F.files(layout)))
    offset = draw(st.integers(0, 1 << 20))
    length = draw(st.integers(0, 4095))
    value = draw(st.integers(0, 255))
    entries = [e for e in F.ENTRIES if e != 'resume' or layout in F.RESUMABLE]
    if mutation.endswith('_resigned'):  # content, not bytes: see the module docstring
        entries = [e for e in entries if e != 'resume']
    entry = draw(st.sampled_from(entries))
    return (layout, mutation, target, offset, length, value), entry


def _load_damaged(case: tuple[tuple, str], tmp_path: Path) -> None:
    (layout, mutation, *_), entry = case
    outcome, detail = F.run_case(case[0], tmp_path / 'case', entry)
    _ok(outcome, detail, mutation)


@FUZZ
@given(case=cases())
def test_damaged_checkpoints_load_exactly_or_raise_named_errors(case, tmp_path):
    _load_damaged(case, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(FUZZ, max_examples=1500)
@given(case=cases())
def test_damaged_checkpoints_soak(case, tmp_path):
    """The property above over ten times the examples (its own derandomized sequence)."""
    _load_damaged(case, tmp_path)


@pytest.mark.parametrize('layout', F.LAYOUTS)
@pytest.mark.parametrize('mutation', F.MUTATIONS)
def test_each_mutation_of_each_layout(layout, mutation, tmp_path):
    if layout == 'deepspeed' and not _deepspeed():
        pytest.skip(NO_DEEPSPEED)
    for target in F.files(layout):
        for entry in F.ENTRIES:
            if entry == 'resume' and layout not in F.RESUMABLE:
                continue
            case = (layout, mutation, target, 1234, 77, 5)
            outcome, detail = F.run_case(case, tmp_path / 'case', entry)
            if mutation.endswith('_resigned') and entry == 'resume':
                continue  # content under a re-signed manifest: see the module docstring
            _ok(outcome, detail, mutation)
            detectable = ('manifest_digest', 'truncate', 'zero', 'append', 'manifest_cut')
            if mutation in detectable and not (
                target.endswith('manifest.json') and mutation in F.BYTE_MUTATIONS
            ):
                assert outcome == 'named', (case, entry)


def test_missing_manifest_loads_with_its_warning(tmp_path):
    from stratagem.checkpoint.errors import UnverifiedCheckpointWarning

    ckpt = F.copy('single', tmp_path / 'ckpt')
    F.mutate(ckpt, 'single', 'manifest_delete', '', 0, 0, 0)
    with pytest.warns(UnverifiedCheckpointWarning):
        got = F.load('load_checkpoint', 'single', ckpt, tmp_path / 'work')
    assert F._same(got, F.expected_weights('single'))


@pytest.mark.parametrize('layout', ('single', 'fsdp'))
def test_manifest_claiming_a_terabyte_is_refused_without_reading(layout, tmp_path):
    ckpt = F.copy(layout, tmp_path / 'ckpt')
    folder = ckpt.parent if ckpt.is_file() else ckpt
    mfile = folder / F.manifest_name(layout)
    manifest = json.loads(mfile.read_text())
    manifest['files'][-1]['size'] = 1 << 40
    mfile.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match='1099511627776'):
        F.load('load_checkpoint', layout, ckpt, tmp_path / 'work')


def test_dcp_metadata_claiming_huge_tensors_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = F.copy('fsdp', tmp_path / 'ckpt')
    meta_file = ckpt / '.metadata'
    metadata = pickle.loads(meta_file.read_bytes())
    key, item = next(
        (k, v)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    )
    item.size = torch.Size([1 << 40, 4])
    item.chunks[0].sizes = torch.Size([1 << 40, 4])
    meta_file.write_bytes(pickle.dumps(metadata))
    F.resign(ckpt / 'manifest.json', meta_file)
    for entry in ('load_checkpoint', 'convert', 'resume'):
        with pytest.raises(CheckpointCorruptError, match='claims .* bytes'):
            F.load(entry, 'fsdp', ckpt, tmp_path / f'work_{entry}')


def test_cli_convert_of_a_damaged_checkpoint_names_it(tmp_path, capsys):
    from stratagem.cli import main

    ckpt = F.copy('fsdp', tmp_path / 'ckpt')
    F.mutate(ckpt, 'fsdp', 'truncate_resigned', '__1_0.distcp', 20000, 0, 0)
    assert main(['convert', str(ckpt), str(tmp_path / 'out.pth')]) == 1
    err = capsys.readouterr().err
    assert 'stratagem convert:' in err and str(ckpt) in err and 'damaged' in err
    assert not (tmp_path / 'out.pth').exists()


# --------------------------------------- safetensors files: the library, our named errors
def _file(tmp: Path, header: bytes, body: bytes = b'', n: int | None = None) -> Path:
    path = tmp / 'x.safetensors'
    path.write_bytes(struct.pack('<Q', len(header) if n is None else n) + header + body)
    return path


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_entry = st.fixed_dictionaries(
    {
        'dtype': st.sampled_from(['F32', 'F16', 'BF16', 'I64', 'U8', 'BOOL', 'F33', '', 'f32']),
        'shape': st.lists(st.integers(-2, 1 << 40), max_size=3),
        'data_offsets': st.lists(st.integers(-8, 1 << 40), min_size=0, max_size=3),
    }
)


@settings(
    derandomize=True,
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    header=st.dictionaries(st.text(max_size=6), _entry | _json, max_size=4),
    body=st.binary(max_size=64),
    claimed=st.none() | st.integers(0, (1 << 64) - 1),
    junk=st.none() | st.binary(max_size=40),
)
def test_safetensors_reader_refuses_bad_headers_by_name(header, body, claimed, junk, tmp_path):
    pytest.importorskip('safetensors')
    raw = junk if junk is not None else json.dumps(header).encode()
    path = _file(tmp_path, raw, body, claimed)
    try:
        tensors, metadata = read_safetensors(path)
    except CheckpointCorruptError as err:
        assert str(path) in str(err)
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert total == len(body)  # accepted only when the entries tile the data exactly


@settings(
    derandomize=True,
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    offset=st.integers(0, 10_000),
    mutation=st.sampled_from(['flip', 'truncate', 'append', 'zero']),
    value=st.integers(0, 255),
)
def test_safetensors_damaged_bytes(offset, mutation, value, tmp_path):
    pytest.importorskip('safetensors')
    weights = {
        'a': torch.arange(6, dtype=torch.float32).reshape(2, 3),
        'b': torch.ones(4, dtype=torch.int64),
    }
    path = save_safetensors_file(weights, tmp_path / 'w.safetensors', metadata={'k': 'v'})
    data = bytearray(path.read_bytes())
    offset %= len(data)
    if mutation == 'flip':
        data[offset] ^= 1 << (value % 8)
    elif mutation == 'truncate':
        del data[offset:]
    elif mutation == 'append':
        data += bytes([value]) * (offset % 50 + 1)
    else:
        data[offset : offset + 16] = bytes(len(data[offset : offset + 16]))
    path.write_bytes(bytes(data))
    try:
        read_safetensors(path)
    except CheckpointCorruptError as err:
        assert str(path) in str(err)


def test_safetensors_header_claiming_huge_tensor_is_refused(tmp_path):
    pytest.importorskip('safetensors')
    header = json.dumps({'w': {'dtype': 'F32', 'shape': [1 << 40], 'data_offsets': [0, 1 << 42]}})
    path = _file(tmp_path, header.encode(), b'\0' * 16)
    with pytest.raises(CheckpointCorruptError, match=f'{path}: not a readable safetensors file'):
        read_safetensors(path)
    with pytest.raises(CheckpointCorruptError, match='not a readable safetensors file'):
        read_safetensors(_file(tmp_path, b'{}', n=(1 << 64) - 1))
    overlap = {
        'a': {'dtype': 'U8', 'shape': [4], 'data_offsets': [0, 4]},
        'b': {'dtype': 'U8', 'shape': [4], 'data_offsets': [2, 6]},
    }
    with pytest.raises(CheckpointCorruptError, match='not a readable safetensors file'):
        read_safetensors(_file(tmp_path, json.dumps(overlap).encode(), b'\0' * 6))


# ------------------------------------------------------- resumes on 2 gloo ranks
# FSDPStrategy and DeepSpeedStrategy resume damaged copies on 2 ranks: every rank raises the
# named error, none hangs (a rank-1 shard truncated under a re-signed manifest once left rank 0
# waiting in DeepSpeed's collective while rank 1 failed in its read).
TWO_RANK_CASES = {
    'fsdp': [
        ('manifest_digest', 'manifest.json', 1),
        ('truncate_resigned', '__1_0.distcp', 20000),
        ('flip_resigned', '.metadata', 4000),
        ('delete', '__0_0.distcp', 0),
    ],
    'deepspeed': [
        ('manifest_digest', 'manifest.json', 2),
        ('truncate_resigned', 'deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt', 3000),
        ('zero_resigned', 'stratagem_state.pth', 100),
    ],
}
SCENARIOS = Scenarios(ranks=dict(nproc=2, timeout=300))


def _resume_damaged(layout: str, root: str) -> dict:
    from stratagem.strategies import build_strategy

    out = {}
    for mutation, _target, _offset in TWO_RANK_CASES[layout]:
        ckpt = Path(root) / f'{layout}_{mutation}' / F.EXPECTED[layout]['checkpoint'].split('/')[-1]
        s = build_strategy(
            dict(
                F.EXPECTED[layout]['strategy'],
                work_dir=str(Path(root) / f'work_{layout}_{mutation}'),
                env_kwargs=dict(randomness=dict(seed=7)),
            )
        )
        s.prepare(F.net(), **F.EXPECTED[layout]['components'])
        try:
            s.resume(str(ckpt))
            out[mutation] = ('loaded', '')
        except Exception as err:  # noqa: BLE001 - the test classifies it
            out[mutation] = (type(err).__name__, str(err)[:500])
    return out


@SCENARIOS.add('ranks')
def fsdp_damaged_on_two_ranks(root: str) -> dict:
    return _resume_damaged('fsdp', root)


@SCENARIOS.add('ranks')
def deepspeed_damaged_on_two_ranks(root: str) -> dict | None:
    return _resume_damaged('deepspeed', root) if _deepspeed() else None


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    root = tmp_path_factory.mktemp('damaged')
    for layout, cases in TWO_RANK_CASES.items():
        if layout == 'deepspeed' and not _deepspeed():
            continue
        for mutation, target, offset in cases:
            ckpt = F.copy(layout, root / f'{layout}_{mutation}')
            F.mutate(ckpt, layout, mutation, target, offset, 64, 0)
    return SCENARIOS.run(request, root)


def _assert_named_on_every_rank(ranks, layout: str) -> None:
    named = (
        'CheckpointCorruptError',
        'NotACheckpointError',
        'UnsafeCheckpointError',
        'FileNotFoundError',
    )
    for out in ranks:
        for mutation, (kind, message) in out.items():
            if kind == 'loaded' and mutation.endswith('_resigned'):
                continue  # a byte nothing reads, or one nothing can tell (re-signed)
            assert kind in named, (layout, mutation, kind, message)
            assert F.EXPECTED[layout]['checkpoint'].split('/')[-1] in message, message


@pytest.mark.scenario('fsdp_damaged_on_two_ranks')
def test_fsdp_damaged_resume_on_two_ranks_names_the_file(scenario):
    _assert_named_on_every_rank(scenario, 'fsdp')


@pytest.mark.scenario('deepspeed_damaged_on_two_ranks')
def test_deepspeed_damaged_resume_on_two_ranks_names_the_file(scenario):
    if not _deepspeed():
        pytest.skip(NO_DEEPSPEED)
    _assert_named_on_every_rank(scenario, 'deepspeed')
