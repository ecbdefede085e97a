"""#42 deliverable 2's last sentence: the debris of a directory save that died (FSDP's, DeepSpeed's
directory killed after its files went up, before its manifest) is listed by ``stratagem doctor``
(``store_debris.find_debris``) and removed by retention once it cannot belong to a save in
flight, parametrised over a local directory (a dead writer's staging directory) and a prefix on
the real local S3 server (objects under a name no manifest lists, and an incomplete multipart
upload under it); and retention at a URL counted in store requests."""

import collections
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from stratagem import checkpoint as ckpt
from stratagem.checkpoint import location, transfer
from stratagem.checkpoint.directory import (
    begin_directory_save,
    save_directory,
    write_directory_files,
)
from stratagem.checkpoint.location import is_url, join

BIG = 6 << 20  # two parts of S3's smallest size: the upload dies between them


@pytest.fixture(params=['local', 's3'])
def where(request, tmp_path):
    if request.param == 'local':
        return str(tmp_path / 'ckpts')
    return f'{request.getfixturevalue("s3")}/ckpts'


def _writer(step, big=False):
    def write(staging):
        torch.save({'w': torch.full((4,), float(step))}, staging / 'a.pt')
        names = ['a.pt']
        if big:
            (staging / 'b.bin').write_bytes(os.urandom(BIG))
            names.append('b.bin')
        return names

    return write


def _save(where, step, **kw):
    return save_directory(join(where, f'iter_{step}'), _writer(step), step=step, **kw)


def _killed_save(where, step, staging_root):
    """A directory save of ``iter_{step}`` in a forked process that dies (``os._exit``)
    after its small file went up and during its big file's multipart upload, after the
    first part (at a URL); on disk, after it wrote its staging directory."""
    import tempfile

    tempfile.tempdir = str(staging_root)  # a URL save's local staging, not the system's
    final = join(where, f'iter_{step}')
    staging = begin_directory_save(final)
    written = write_directory_files(staging, _writer(step, big=True))
    if not is_url(where):
        os._exit(0)

    async def first_part_then_die(call, ids, local, size, part, concurrency):
        with open(local, 'rb') as file:
            body = file.read(part)
        await call('upload_part', PartNumber=1, Body=body, **ids)
        os._exit(0)

    # the soak's setting: objects above S3's smallest part go up in parts
    transfer.PART_BYTES = transfer.MULTIPART_BYTES = transfer.MIN_PART_BYTES
    transfer._put_parts = first_part_then_die
    from stratagem.checkpoint.remote_directory import upload_directory_files

    upload_directory_files(staging, final, written.files)
    os._exit(1)  # not reached: the upload died


def _next_second():
    """The store's times have a resolution of 1 s."""
    time.sleep(1.02 - time.time() % 1)


def _retain(where, **kw):
    if is_url(where):
        return location.apply_retention(where, 5, pattern='iter_*', **kw)
    return ckpt.apply_retention(where, 5, pattern='iter_*')


def _leftovers(where):
    """What is left of the killed saves: debris at a URL, staging directories on disk."""
    if is_url(where):
        from stratagem.checkpoint.store_debris import find_debris

        return sorted((d.url[len(where) + 1 :], d.kind) for d in find_debris(where))
    return sorted((p.name.split('.tmp-')[0][1:], 'staging') for p in Path(where).glob('.*.tmp-*'))


def test_a_killed_directory_save_is_listed_and_removed_once_it_cannot_be_in_flight(where, tmp_path):
    """iter_3 and iter_4 committed; a save of iter_6 dies mid-upload (or mid-write); the run
    resumes from iter_4 and saves iter_5. Doctor lists iter_6's leftovers; retention keeps
    them while iter_6 is named as in flight, then removes them (objects and the incomplete
    multipart upload), never a committed checkpoint nor the objects of a save begun after
    the newest commit (iter_7: another rank still uploading)."""
    from stratagem.checkpoint.store_debris import find_debris

    _save(where, 3)
    _save(where, 4)
    child = multiprocessing.get_context('fork').Process(
        target=_killed_save, args=(where, 6, tmp_path)
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    remote = is_url(where)
    if remote:
        died = [('iter_6', 'unlisted directory'), ('iter_6/b.bin', 'incomplete multipart upload')]
        assert _leftovers(where) == died
        found = {d.kind: d for d in find_debris(where)}  # what doctor lists
        a_pt = location.survey(join(where, 'iter_6')).entries[0]['size']
        assert found['unlisted directory'].describe() == (
            f'{where}/iter_6 (unlisted directory, 1 object, {a_pt} bytes)'
        )
        assert found['incomplete multipart upload'].size == transfer.MIN_PART_BYTES
        _next_second()
    else:
        assert _leftovers(where) == [('iter_6', 'staging')]

    _save(where, 5)  # the resumed run's next save: now iter_6's leftovers predate a commit
    live = join(where, 'iter_7')
    if remote:  # a save begun after that commit, its manifest not yet written
        fs, path = location.filesystem(live)
        fs.pipe_file(f'{path}/__1_0.distcp', b'rank 1 is still uploading')
        assert _retain(where, protect=[join(where, 'iter_6')]) == []
        assert _leftovers(where) == [*died, ('iter_7', 'unlisted directory')]
    else:
        staging = begin_directory_save(live)  # a live writer's: this process's pid
        (staging / 'a.pt').write_bytes(b'still writing')
    _retain(where)

    expected = [('iter_7', 'unlisted directory' if remote else 'staging')]
    assert _leftovers(where) == expected
    if remote:
        fs, path = location.filesystem(where)
        bucket, key, _ = fs.split_path(path)
        assert (
            fs.call_s3('list_multipart_uploads', Bucket=bucket, Prefix=key).get('Uploads') is None
        )
        assert fs.find(f'{path}/iter_6') == []
        names = [c.url.rsplit('/', 1)[-1] for c in location.list_checkpoints(where)]
    else:
        names = [c.path.name for c in ckpt.list_checkpoints(where)]
    assert names == ['iter_5', 'iter_4', 'iter_3']
    for name in names:
        if remote:
            from stratagem.checkpoint.remote_directory import verify_remote_directory

            verify_remote_directory(join(where, name), collective=False)
        else:
            ckpt.verify_checkpoint(join(where, name))


def test_retention_at_a_url_lists_once_and_deletes_by_the_manifest_in_hand(s3, s3_server, tmp_path):
    """Five checkpoints (files and directories), keep 2: one listing, one read per manifest
    and of the pointer, two deletes per file (object, then manifest), a directory's manifest
    then its objects (a listing, one batch delete), one listing of multipart uploads: 15
    requests (29 before: the listing and every manifest read twice, each read a HEAD first,
    and a probe for a directory manifest before each delete). A folder of another tool's
    beside them (no manifest, not the series' name) costs none: retention could not remove
    it, so it is not listed."""
    from s3_faults import FaultProxy

    prefix = f'{s3}/run'
    for step in range(1, 6):
        if step % 2:
            local = ckpt.save_checkpoint(
                {'meta': {'iter': step}, 'w': torch.ones(4)},
                tmp_path / f'iter_{step}.pth',
                step=step,
                update_pointer=False,
            )
            location.upload_file(local, f'{prefix}/iter_{step}.pth')
        else:
            _save(prefix, step, collective=False)
    location.filesystem(prefix)[0].pipe_file(f'{prefix}/notes/readme.txt'.split('://')[1], b'x')
    proxy = FaultProxy(s3_server.endpoint).start()
    try:
        args = dict(endpoint_url=proxy.endpoint, skip_instance_cache=True)
        removed = location.apply_retention(prefix, 2, pattern='iter_*', backend_args=args)
        seen = list(proxy.seen)
    finally:
        proxy.stop()
    assert [r.rsplit('/', 1)[-1] for r in removed] == ['iter_3.pth', 'iter_2', 'iter_1.pth']
    assert collections.Counter(method for method, _ in seen) == {
        # the listing, 5 manifests, the pointer, the deleted directory's objects, uploads;
        # the foreign folder's manifest (the survey's: is it a checkpoint?), never a listing
        'GET': 10,
        'DELETE': 5,
        'POST': 1,  # the directory's objects in one batch
    }
    assert len(seen) == 16
    assert location.filesystem(prefix)[0].exists(f'{prefix}/notes/readme.txt'.split('://')[1])
    assert [c.url.rsplit('/', 1)[-1] for c in location.list_checkpoints(prefix)] == [
        'iter_5.pth',
        'iter_4',
    ]
