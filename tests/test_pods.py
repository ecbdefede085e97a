"""Two "pods" on this machine, as a cluster operator would start them: two processes, each with
the variables its operator sets and no torchrun of ours in between, give one run whose final
state equals ``stratagem train --nproc 2``'s (the session's reference run, ``uninterrupted_run``
in tests/conftest.py) bit for bit.

- a Kubeflow PyTorchJob pod running ``stratagem train CFG``: ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``, no ``LOCAL_RANK`` (one process per pod);
- a Kubeflow TrainJob node (torchrun's ``PET_*``) running ``stratagem train CFG --nproc 1``:
  each starts torchrun with ``--nnodes 2 --node-rank i`` from the variables (slow tier: two
  torchrun agents).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dist_harness import free_port
from failure_helpers import clean_env, end_together, equal, final_state

_PORT_TAKEN = ('address already in use', 'EADDRINUSE')


def _pods(cfg, work, tmp, envs, *extra):
    """Start one ``stratagem train`` per environment in ``envs`` (the last first: rank 0 hosts
    the rendezvous); return (exit codes, outputs). A pod that fails ends the wait 5 s later:
    the other would wait for it up to the rendezvous timeout."""
    logs = [open(tmp / f'pod{i}.log', 'w') for i in range(len(envs))]  # noqa: SIM115
    procs = {}
    for i in reversed(range(len(envs))):
        procs[i] = subprocess.Popen(
            [sys.executable, '-m', 'stratagem', 'train', str(cfg), '--work-dir', str(work), *extra],
            env=clean_env(**envs[i]),
            stdout=logs[i],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        by_pod = end_together(procs)
    finally:
        for log in logs:
            log.close()
    codes = [by_pod[i] for i in range(len(envs))]
    return codes, [(tmp / f'pod{i}.log').read_text() for i in range(len(envs))]


def _run_pods(tmp_path, cfg, make_envs, *extra):
    work = tmp_path / 'work'
    for attempt in range(2):
        codes, outs = _pods(cfg, work, tmp_path, make_envs(free_port()), *extra)
        if codes == [0, 0] or not any(s in ''.join(outs) for s in _PORT_TAKEN) or attempt:
            break
        # the free port was taken (by another job on this machine) before rank 0 bound it
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    assert codes == [0, 0], (
        f'exit codes {codes}\npod 0:\n{outs[0][-3000:]}\npod 1:\n{outs[1][-3000:]}'
    )
    return work, outs


def test_two_pytorchjob_pods_equal_nproc_2_bit_for_bit(tmp_path, uninterrupted_run):
    cfg, want = uninterrupted_run

    def envs(port):
        pod = dict(WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
        return [{**pod, 'RANK': str(rank)} for rank in (0, 1)]

    work, outs = _run_pods(tmp_path, cfg, envs)
    got = final_state(work)
    assert got['iter'] == want['iter'] == 32
    assert equal(got, want)
    meta = torch.load(work / 'iter_32.pth', weights_only=True)['meta']
    assert meta['world_size'] == 2  # one run of two, not two runs of one
    assert 'torch.distributed.run' not in ''.join(outs)  # no torchrun of ours in between


@pytest.mark.slow
def test_two_trainjob_nodes_with_pet_variables_equal_nproc_2_bit_for_bit(
    tmp_path, uninterrupted_run
):
    cfg, want = uninterrupted_run

    def envs(port):
        node = dict(PET_NNODES='2', PET_MASTER_ADDR='127.0.0.1', PET_MASTER_PORT=str(port))
        return [{**node, 'PET_NODE_RANK': str(rank)} for rank in (0, 1)]

    work, _ = _run_pods(tmp_path, cfg, envs, '--nproc', '1')
    got = final_state(work)
    assert got['iter'] == want['iter'] == 32
    assert equal(got, want)
