"""#42: the kill-during-upload soak (slow tier). A process saving an 8 MiB checkpoint to the
real local S3 server after every iteration is SIGKILLed at a random moment, again and
again, until at least 20 kills fell inside a save (between its ``saving N`` and ``saved N``
lines: the local commit, the upload, the manifest, the pointer, the retention) and at least
one inside a multipart upload: every other process uploads in two parts, one after the
other, so kills land between parts too. After every kill: the pointer names a checkpoint
whose manifest lists it, every committed checkpoint loads and verifies (read again whenever
its object or manifest changed), the automatic resume picks the pointed one, and ``stratagem
doctor``'s listing (``find_debris``) names the incomplete multipart upload a kill left. Each
restart resumes from the bucket, and its retention removes those uploads; the last one runs
to the end, and its final state equals the uninterrupted run's byte for byte; no upload
debris is left, no multipart upload either."""

import multiprocessing
import random
import time

import pytest

from stratagem.checkpoint import location
from stratagem.checkpoint.manifest import SIDECAR_SUFFIX
from stratagem.checkpoint.store_debris import find_debris

MID_SAVE_KILLS = 20


def _start(ctx, prefix, max_iters, work_dir, out, log, multipart=False):
    from soak_upload_child import child

    proc = ctx.Process(
        target=child, args=(prefix, max_iters, str(work_dir), str(out), str(log), multipart)
    )
    proc.start()
    return proc


def _lines(log):
    return log.read_text().splitlines() if log.exists() else []


def _wait_for(log, proc, word, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(line.startswith(word) for line in _lines(log)):
            return
        if not proc.is_alive():
            break
        time.sleep(0.02)
    raise AssertionError(f'no {word!r} line from the child: {_lines(log)[-20:]}')


def _protocol(lines):
    """The child's own lines (its log lines share the pipe)."""
    return [line for line in lines if line.split(' ')[0] in {'resumed', 'saving', 'saved', 'done'}]


def _check_untorn(prefix, verified):
    """The pointer on a committed checkpoint; every committed one verifies and loads. One
    whose object and manifest are the very ones an earlier check verified (``verified``:
    names with both ETags) is not read again: any write to either changes its ETag."""
    listing = location.survey(prefix)
    committed = [c.url for c in listing.committed]
    pointer = location.read_pointer(prefix)
    if pointer is not None:
        assert pointer in committed, (pointer, committed)
        assert location.find_latest(prefix) == pointer
    tags = {e['name'].rsplit('/', 1)[-1]: e.get('ETag') for e in listing.entries}
    for url in committed:
        name = url.rsplit('/', 1)[-1]
        seen = (name, tags.get(name), tags.get(name + SIDECAR_SUFFIX))
        if None in seen or seen not in verified:
            assert location.load_file(url)['meta']['iter'] == int(name[len('iter_') : -4])
            verified.add(seen)
    return pointer


def _uploads(prefix):
    """The incomplete multipart uploads under ``prefix`` (one request)."""
    fs, path = location.filesystem(prefix)
    bucket, key, _ = fs.split_path(path)
    found = fs.call_s3('list_multipart_uploads', Bucket=bucket, Prefix=f'{key}/')
    return {u['UploadId'] for u in found.get('Uploads') or []}


def _listed_uploads(prefix):
    """The incomplete multipart uploads a kill left, each listed by doctor's listing
    (``find_debris``; asked only when there is one)."""
    uploads = _uploads(prefix)
    if uploads:
        debris = find_debris(prefix)
        assert {d.upload_id for d in debris if d.kind == 'incomplete multipart upload'} == uploads
    return uploads


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_at_random_points_of_uploads_never_tears_a_checkpoint(s3, tmp_path):
    from soak_upload_child import run

    # children forked from a server that imported torch, stratagem and s3fs once
    ctx = multiprocessing.get_context('forkserver')
    ctx.set_forkserver_preload(['torch', 's3fs', 'stratagem.strategies', 'soak_upload_child'])
    prefix = f'{s3}/soak'
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    work_dir, out = tmp_path / 'work', tmp_path / 'final.bin'
    mid_save, kills, positions, torn_uploads, verified = 0, 0, [], set(), set()
    while mid_save < MID_SAVE_KILLS or not torn_uploads:
        assert kills < 4 * MID_SAVE_KILLS, f'seed {seed}: too few kills inside a save {positions}'
        log = tmp_path / f'run{kills}.log'
        proc = _start(ctx, prefix, 10_000, work_dir, out, log, multipart=kills % 2 == 1)
        try:
            _wait_for(log, proc, 'resumed')
            time.sleep(rng.uniform(0.0, 2.0))
        finally:
            proc.kill()
            proc.join()
        assert proc.exitcode == -9, _lines(log)[-20:]
        kills += 1
        said = _protocol(_lines(log))
        last = said[-1] if said else ''
        positions.append(last)
        mid_save += last.startswith('saving')
        _check_untorn(prefix, verified)
        torn_uploads |= _listed_uploads(prefix)

    pointer = _check_untorn(prefix, verified)
    assert pointer is not None, f'seed {seed}: nothing was ever committed: {positions}'
    end = int(pointer.rsplit('_', 1)[1][:-4]) + 3
    log = tmp_path / 'last.log'
    proc = _start(ctx, prefix, end, work_dir, out, log)
    proc.join(timeout=300)
    assert proc.exitcode == 0, _lines(log)[-30:]
    said = _protocol(_lines(log))
    assert said[0] == f'resumed {end - 3}' and said[-1] == 'done', said
    assert out.read_bytes() == run(None, end, str(tmp_path / 'reference'))
    assert location.read_pointer(prefix) == f'{prefix}/iter_{end}.pth'
    assert find_debris(prefix) == []  # retention removed every kill's debris
    assert _uploads(prefix) == set()
    print(
        f'soak: {kills} SIGKILLs, {mid_save} inside a save, {len(torn_uploads)} inside a '
        f'multipart upload, 0 torn (seed {seed}): {positions}'
    )
