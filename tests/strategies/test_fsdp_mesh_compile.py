"""FSDPStrategy on the 2-D mesh ``(shard 2, tensor 2)`` with each block's forward compiled
(``prepare(compile=True)``: ``torch.compile`` per block, inductor on CPU), 4 gloo processes:
8 AdamW steps with accumulation and clipping end at the uncompiled run's weights (float64,
within 1e-9 relative) and at one process's (1e-5, as test_fsdp_mesh.py's meshes).

Slow tier: the compilation costs tens of seconds per rank on 2 cores. The uncompiled mesh
runs stay in the first tier (test_fsdp_mesh.py, whose helpers this module shares).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_fsdp_mesh import (  # the mesh module's model, data, strategy and loop
    MESHES,
    OPTIM,
    STEPS,
    _full_state,
    _max_rel,
    _model,
    _reference,
    _reference_init,
    _strategy,
    _train,
)

from scenarios import Scenarios

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCENARIOS = Scenarios(four=dict(nproc=4, timeout=800))


@SCENARIOS.add('four')
def compiled_2d(work):
    from torch._dynamo.utils import counters

    out = {}
    for kind, compile in (('eager', False), ('compiled', True)):
        s = _strategy(Path(work) / kind, MESHES['2d'][0])
        model = _model()
        torch.manual_seed(1)  # prepare's init_weights draws as the reference's does
        model, ow = s.prepare(
            model, optim_wrapper=OPTIM, compile=compile, dispatch_kwargs=dict(max_iters=STEPS)
        )
        _train(s, model, ow, 0, STEPS)
        out[kind] = _full_state(s)[0]
        if compile:
            out['compiled_blocks'] = [
                n for n, m in model.named_modules() if m._compiled_call_impl is not None
            ]
            out['graphs'] = counters['stats']['unique_graphs']  # traced, not only registered
    out['reference'] = _reference(s.data_parallel_size)
    return out


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('mesh_compile'))


@pytest.mark.scenario('compiled_2d')
def test_compiled_blocks_on_the_2d_mesh_train_as_uncompiled(scenario):
    for res in scenario:
        assert res['compiled_blocks'] == ['blocks.0', 'blocks.1'] and res['graphs'] >= 1
        assert _max_rel(res['compiled'], res['eager'])[0] < 1e-9, _max_rel(
            res['compiled'], res['eager']
        )
        assert _max_rel(res['compiled'], res['reference'])[0] < 1e-5
        assert _max_rel(res['compiled'], _reference_init())[0] > 1e-2  # it trained
