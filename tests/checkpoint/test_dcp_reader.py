"""ShardReader: DCP files read without one torch.load per tensor, with the same result as
DCP's FileSystemReader, and falling back to it for anything but a plain tensor."""

import io
import pickle
import warnings

import pytest
import torch

from stratagem.checkpoint import dcp_reader
from stratagem.checkpoint.dcp_reader import ShardReader, tensor_from_archive

dcp = pytest.importorskip('torch.distributed.checkpoint')


def _archive(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    'tensor',
    [
        torch.arange(12, dtype=torch.float32).reshape(4, 3),
        torch.arange(12, dtype=torch.float32).reshape(4, 3).to(torch.bfloat16),
        torch.tensor(3.5, dtype=torch.float64),
        torch.arange(35, dtype=torch.float32).reshape(5, 7).t(),  # transposed strides
        torch.arange(60, dtype=torch.int64).reshape(3, 4, 5).permute(2, 0, 1),
        torch.arange(10, dtype=torch.float16)[2:6],  # a view: offset 2 into a 10-element storage
        torch.tensor([True, False, True]),
        torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64),
        torch.empty(0, 3),
    ],
    ids=[
        'f32',
        'bf16',
        'scalar',
        'transposed',
        'permuted',
        'offset_view',
        'bool',
        'complex',
        'empty',
    ],
)
def test_plain_tensors_read_exactly(tensor):
    out = tensor_from_archive(_archive(tensor))
    assert out is not None
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert out.stride() == tensor.stride() and not out.requires_grad
    assert torch.equal(out, tensor)


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ('echo pwned > /dev/null',))


@pytest.mark.parametrize(
    'obj',
    [
        torch.zeros(3, requires_grad=True),  # rebuilt with requires_grad: torch.load's job
        torch.nn.Parameter(torch.zeros(3)),
        {'a': torch.zeros(3)},
        [torch.zeros(2)],
        7,
    ],
    ids=['requires_grad', 'parameter', 'dict', 'list', 'int'],
)
def test_anything_else_is_left_to_torch_load(obj):
    assert tensor_from_archive(_archive(obj)) is None


def test_a_pickle_naming_other_code_runs_nothing(monkeypatch):
    blob = _archive(_Evil())
    called = []
    monkeypatch.setattr('os.system', lambda *a: called.append(a))
    assert tensor_from_archive(blob) is None
    assert tensor_from_archive(b'not a zip archive') is None
    assert called == []


def _patched(blob: bytes, record: str, new: bytes) -> bytes:
    """``blob`` with one record's bytes replaced (same length)."""
    reader = torch._C.PyTorchFileReader(io.BytesIO(blob))
    start, old = reader.get_record_offset(record), reader.get_record(record)
    assert len(new) == len(old)
    return blob[:start] + new + blob[start + len(old) :]


def test_big_endian_or_short_records_are_not_read_here():
    blob = _archive(torch.arange(6, dtype=torch.float32))
    assert tensor_from_archive(blob) is not None
    # 'little' -> 'bigxx': torch.load would byte-swap; we do not guess
    assert tensor_from_archive(_patched(blob, 'byteorder', b'bigxxx')) is None
    # the pickle promises more elements than the data record holds
    pkl = torch._C.PyTorchFileReader(io.BytesIO(blob)).get_record('data.pkl')
    assert b'K\x06' in pkl  # BININT1 6: the storage's element count
    longer = _patched(blob, 'data.pkl', pkl.replace(b'K\x06', b'K\x07', 1))
    assert tensor_from_archive(longer) is None
    # a shape reaching past the storage
    wide = _patched(blob, 'data.pkl', pkl.replace(b'K\x06\x85', b'K\x07\x85', 1))
    assert tensor_from_archive(wide) is None


def _rebuilt(blob: bytes, records: dict | None = None, deflate: tuple = ()) -> bytes:
    """``blob``'s archive written again by torch's writer, some records replaced; or by
    zipfile, with the ``deflate``d records compressed (torch.load inflates them)."""
    import zipfile

    reader = torch._C.PyTorchFileReader(io.BytesIO(blob))
    recs = {n: reader.get_record(n) for n in reader.get_all_records()}
    recs.update(records or {})
    out = io.BytesIO()
    if deflate:
        with zipfile.ZipFile(out, 'w') as archive:
            for name, data in recs.items():
                archive.writestr(
                    f'archive/{name}',
                    data,
                    compress_type=zipfile.ZIP_DEFLATED if name in deflate else zipfile.ZIP_STORED,
                )
        return out.getvalue()
    writer = torch._C.PyTorchFileWriter(out)
    for name, data in recs.items():
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return out.getvalue()


def _storage_pid(storage: bytes) -> bytes:
    """A BINPERSID of ``('storage', torch.<storage>, '0', 'cpu', 4)``."""
    return (
        b'(X\x07\x00\x00\x00storagectorch\n'
        + storage
        + b'\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ'
    )


def _tensor_pickle(storage: bytes, before: bytes = b'') -> bytes:
    """data.pkl of a float tensor of 4 elements on storage '0', after ``before``."""
    return (
        b'\x80\x02'
        + before
        + b'ctorch._utils\n_rebuild_tensor_v2\n('
        + _storage_pid(storage)
        + b'K\x00K\x04\x85K\x01\x85\x89ccollections\n'
        b'OrderedDict\n)RtR.'
    )


def test_crafted_archives_fall_back_to_torch_load(capsys):
    """What torch.load reads one way must never be read another way here (a second review's
    findings): each case below is None, and torch.load gives the reference values."""
    expected = torch.arange(4, dtype=torch.float32) + 0.5
    blob = _archive(expected)
    assert torch.equal(
        tensor_from_archive(_rebuilt(blob, {'data.pkl': _tensor_pickle(b'FloatStorage')})), expected
    )  # the hand-made pickle itself is fine
    cases = {
        # compressed storage bytes: torch.load inflates them
        'deflated': _rebuilt(blob, deflate=('data/0',)),
        # a storage referenced twice: torch.load keeps the first one's dtype (float)
        'two_storages': _rebuilt(
            blob, {'data.pkl': _tensor_pickle(b'IntStorage', before=_storage_pid(b'FloatStorage'))}
        ),
    }
    for name, crafted in cases.items():
        assert torch.equal(torch.load(io.BytesIO(crafted), weights_only=True), expected), name
        assert tensor_from_archive(crafted) is None, name
    # the check behind the opcode check: a second storage reference is refused
    with pytest.raises(pickle.UnpicklingError, match='a second storage reference'):
        dcp_reader._TensorUnpickler(
            io.BytesIO(_tensor_pickle(b'IntStorage', before=_storage_pid(b'FloatStorage')))
        ).load()
    # a storage tuple written as a literal (no persistent reference): torch.load refuses it
    literal = _tensor_pickle(b'FloatStorage').replace(b'tQ', b't', 1)
    assert tensor_from_archive(_rebuilt(blob, {'data.pkl': literal})) is None
    # BUILD on a recorder would change it for the whole process: refused before unpickling
    build = (
        b'\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(N}X\x08\x00\x00\x00__init__'
        b'ccollections\nOrderedDict\nstb.'
    )
    init = dcp_reader._Recipe.__init__
    assert tensor_from_archive(_rebuilt(blob, {'data.pkl': build})) is None
    assert dcp_reader._Recipe.__init__ is init
    # an extension code resolves through copyreg's cache, not find_class: refused
    import copyreg

    copyreg.add_extension('builtins', 'print', 0x42)
    try:
        pickle.loads(b'\x80\x02\x82\x42.')  # caches builtins.print under code 0x42
        ext = b'\x80\x02\x82\x42X\x07\x00\x00\x00called!\x85R.'
        assert tensor_from_archive(_rebuilt(blob, {'data.pkl': ext})) is None
    finally:
        copyreg.remove_extension('builtins', 'print', 0x42)
    assert 'called!' not in capsys.readouterr().out
    # sizes no tensor can have are torch.load's to refuse
    huge = _tensor_pickle(b'FloatStorage').replace(
        b'K\x04\x85', b'\x8a\x09' + b'\x00' * 8 + b'\x01\x85', 1
    )
    assert tensor_from_archive(_rebuilt(blob, {'data.pkl': huge})) is None
    assert torch.equal(tensor_from_archive(blob), expected)  # and plain ones still read here


def _misaligned(blob: bytes, offset_mod_16: int) -> bytes:
    """``blob``'s archive rewritten by zipfile (no alignment), data/0 starting at a chosen
    offset modulo 16 (a padding extra field before it)."""
    import struct
    import zipfile

    reader = torch._C.PyTorchFileReader(io.BytesIO(blob))
    for pad in range(16, 32):
        out = io.BytesIO()
        with zipfile.ZipFile(out, 'w') as archive:
            for name in reader.get_all_records():
                info = zipfile.ZipInfo(f'archive/{name}')
                if name == 'data/0':
                    info.extra = b'\xfe\xca' + struct.pack('<H', pad) + b'\0' * pad
                archive.writestr(info, reader.get_record(name))
        crafted = out.getvalue()
        start = torch._C.PyTorchFileReader(io.BytesIO(crafted)).get_record_offset('data/0')
        if start % 16 == offset_mod_16:
            return crafted
    raise AssertionError('no padding gives that offset')


def test_more_crafted_archives_fall_back():
    """A second review's findings: data torch.load would read into aligned memory (a
    complex128 copy from misaligned bytes crashes), archives torch.load refuses, pickles that
    build more than one tensor, zero-size tensors with their own strides."""
    values = torch.arange(3).to(torch.complex128)
    blob = _archive(values)
    for mod in (8, 3):
        crafted = _misaligned(blob, mod)
        assert torch.equal(torch.load(io.BytesIO(crafted), weights_only=True), values)
        out = tensor_from_archive(crafted)
        if out is not None:  # read here only when the view is aligned for its dtype
            assert out.data_ptr() % 16 == 0 and torch.equal(out.clone(), values)
    floats = torch.arange(4, dtype=torch.float32) + 0.5
    blob = _archive(floats)
    assert tensor_from_archive(b'\0\0\0\0' + blob) is None  # torch.load: not a zip
    assert tensor_from_archive(_rebuilt(blob, {'constants.pkl': b'\x80\x02).'})) is None
    body = (
        b'('
        + _storage_pid(b'FloatStorage')
        + b'K\x00K\x04\x85K\x01\x85\x89'
        + b'ccollections\nOrderedDict\n)R' * 3
        + b'tR.'
    )  # 8 arguments: torch.load raises
    eight = b'\x80\x02ctorch._utils\n_rebuild_tensor_v2\n' + body
    assert tensor_from_archive(_rebuilt(blob, {'data.pkl': eight})) is None
    # a first tensor (one torch.load could not build) left under the result
    first = b'ctorch._utils\n_rebuild_tensor_v2\n(K\x00K\x00K\x00K\x00tR'
    two = _tensor_pickle(b'FloatStorage', before=first)
    assert tensor_from_archive(_rebuilt(blob, {'data.pkl': two})) is None
    empty = torch.empty(0, 10)[:, 2:5]  # size (0, 3), stride (10, 1), offset 2
    out = tensor_from_archive(_archive(empty))
    assert (out.shape, out.stride(), out.storage_offset()) == ((0, 3), (10, 1), 2)


def _save_dcp(path, state):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', UserWarning)  # "assuming ... a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def _load(path, reader):
    state = {
        'w': torch.zeros(4, 3),
        'opt': {'step': torch.tensor(0.0), 'm': torch.zeros(6, dtype=torch.bfloat16)},
        'note': '',
        'count': 0,
    }
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _saved():
    torch.manual_seed(0)
    return {
        'w': torch.randn(4, 3),
        'opt': {'step': torch.tensor(5.0), 'm': torch.randn(6).to(torch.bfloat16)},
        'note': 'kept as bytes',
        'count': 42,
    }


def test_reads_what_filesystemreader_reads_without_torch_load(tmp_path, monkeypatch):
    _save_dcp(tmp_path / 'ck', _saved())
    reference = _load(tmp_path / 'ck', dcp.FileSystemReader(tmp_path / 'ck'))
    handed_on = []  # what ShardReader leaves to FileSystemReader (which torch.loads tensors)
    base_read = dcp.FileSystemReader.read_data

    def recording(self, plan, planner):
        handed_on.extend(item.storage_index.fqn for item in plan.items)
        return base_read(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, 'read_data', recording)
    ours = _load(tmp_path / 'ck', ShardReader(tmp_path / 'ck'))
    assert torch.equal(ours['w'], reference['w']) and torch.equal(ours['w'], _saved()['w'])
    assert torch.equal(ours['opt']['m'], reference['opt']['m'])
    assert float(ours['opt']['step']) == 5.0
    assert (ours['note'], ours['count']) == ('kept as bytes', 42)
    assert sorted(handed_on) == ['count', 'note']  # the byte items; no tensor


def test_unrecognised_items_fall_back_to_dcp(tmp_path, monkeypatch):
    _save_dcp(tmp_path / 'ck', _saved())
    monkeypatch.setattr(dcp_reader, 'tensor_from_archive', lambda blob: None)
    ours = _load(tmp_path / 'ck', ShardReader(tmp_path / 'ck'))
    assert torch.equal(ours['w'], _saved()['w']) and float(ours['opt']['step']) == 5.0
    assert torch.equal(ours['opt']['m'], _saved()['opt']['m'])


def test_given_metadata_is_used_once(tmp_path):
    _save_dcp(tmp_path / 'ck', _saved())
    metadata = dcp.FileSystemReader(tmp_path / 'ck').read_metadata()
    reader = ShardReader(tmp_path / 'ck', metadata=metadata)
    assert reader.read_metadata() is metadata
    again = reader.read_metadata()  # a reused reader reads the file
    assert (
        again is not metadata
        and again.state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    )


def test_a_truncated_shard_file_names_file_and_key(tmp_path):
    _save_dcp(tmp_path / 'ck', _saved())
    shard = next((tmp_path / 'ck').glob('*.distcp'))
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        _load(tmp_path / 'ck', ShardReader(tmp_path / 'ck'))
    text = str(info.value) + repr(getattr(info.value, 'failures', ''))
    assert shard.name in text and 'needs bytes' in text


def test_pickle_module_is_not_the_weights_only_unpickler():
    # the restricted unpickler is the C one (its speed is the point); find_class guards it
    assert issubclass(dcp_reader._TensorUnpickler, pickle.Unpickler)
    with pytest.raises(pickle.UnpicklingError, match='not part of a plain tensor'):
        dcp_reader._TensorUnpickler(io.BytesIO(b'cos\nsystem\n.')).load()
