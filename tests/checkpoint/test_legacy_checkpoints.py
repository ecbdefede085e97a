"""Checkpoints written by earlier code still load, exactly: the frozen ones in tests/data/legacy.

``tests/data/legacy/make_legacy_checkpoints.py`` wrote them (its docstring names the commit
and versions); ``expected.json`` holds the components' configs and the values at each save.
Each test copies the checkpoints to a temporary directory first (nothing writes into
tests/data), loads them with today's API into freshly built components (other weights) and
compares weights, optimizer state, lr, schedulers, counters, meta iteration and RNG bit for
bit.

``tests/data/legacy/make_legacy_partial_grads.py`` wrote ``partial_grads/``: checkpoints taken
inside an accumulation window in format 1 (every rank's pending gradients per optim wrapper
by optimizer index, FSDP's ``partial_grads_fqn``), with the weights the old code reached when
it resumed them and trained on (those of an uninterrupted run). Today's code resumes them on 2
ranks, trains on the same way and must end there bit for bit; resumed in one process, it
continues the window from the mean of the ranks' pending gradients.

Processes start once for the module: the 2-rank resumes (FSDP, DeepSpeed, the mid-window
files) are scenarios of one spawn (tests/scenarios.py), each run only when a selected test
names it; the single-process loads run in this process.
"""

import importlib
import json
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from scenarios import Scenarios

LEGACY = Path(__file__).resolve().parents[1] / 'data' / 'legacy'
EXPECTED = json.loads((LEGACY / 'expected.json').read_text())
NO_DEEPSPEED = 'DeepSpeed is an optional extra (stratagem[deepspeed])'
PARTIAL = json.loads((LEGACY / 'partial_grads' / 'expected.json').read_text())
PARTIAL_CASES = ('ddp', 'ddp_dict', 'fsdp_full')
SCENARIOS = Scenarios(ranks=dict(nproc=2, timeout=300))


def _net() -> nn.Module:
    """The generator's architecture with other weights (its seed is 0), so a load shows."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _decode(entry: dict) -> torch.Tensor:
    return torch.tensor(entry['data'], dtype=getattr(torch, entry['dtype'])).reshape(entry['shape'])


def _copy(layout: str, dst: Path) -> Path:
    """The frozen checkpoint of ``layout`` copied under ``dst``; returns the copy's path."""
    shutil.copytree(LEGACY / layout, dst / layout)
    return dst / EXPECTED[layout]['checkpoint']


def _strategy(layout: str, work_dir, **overrides):
    from stratagem.strategies import build_strategy

    spec = EXPECTED[layout]
    return build_strategy(
        dict(
            spec['strategy'],
            work_dir=str(work_dir),
            env_kwargs=dict(randomness=dict(seed=7)),
            **overrides,
        )
    )


def _state(layout: str, s, optimizer: bool = True) -> tuple[dict, dict]:
    """Full weights and optimizer state by parameter name (the generator's ``_state``;
    ``optimizer=False``: weights only, ``{}``)."""
    if layout == 'single':
        names = {p: n for n, p in s.model.named_parameters()}
        weights = {k: v.detach().clone() for k, v in s.model.state_dict().items()}
        if not optimizer:
            return weights, {}
        optim = {
            names[p]: {k: v.clone() for k, v in st.items()}
            for p, st in s.optim_wrapper.optimizer.state.items()
        }
        return weights, optim
    if layout == 'fsdp':
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        weights = {
            k: v.detach().clone() for k, v in get_model_state_dict(s.model, options=opts).items()
        }
        if not optimizer:
            return weights, {}
        optim = get_optimizer_state_dict(s.model, s.optim_wrapper.optimizer, options=opts)
        return weights, {
            k: {n: v.clone() for n, v in st.items()} for k, st in optim['state'].items()
        }
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    module = s.model.module
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if not optimizer:
        return weights, {}
    link = getattr(s.model.optimizer, '_lazy_init_hp_params_optimizer_state', None)
    if link is not None:  # ZeRO-1/2 link these views at the first step; a resumed engine
        link()  # has not stepped
    # one flat partition per rank, one step count (the generator asserted it)
    steps = sorted({float(st['step']) for st in s.model.optimizer.optimizer.state.values()})
    step = torch.tensor(steps[0] if len(steps) == 1 else float('nan'))
    optim = {
        n: {
            'fp32': safe_get_full_fp32_param(p).clone(),
            **{k: safe_get_full_optimizer_state(p, k).clone() for k in ('exp_avg', 'exp_avg_sq')},
            'step': step.clone(),
        }
        for n, p in module.named_parameters()
    }
    return weights, optim


def _resume(layout: str, root: str, work_dir: str, via: str | None = None) -> dict:
    """Resume ``layout``'s copy into fresh components (built by the strategy of ``via``'s
    layout, by default ``layout``'s own); what the comparison needs."""
    via = via or layout
    s = _strategy(via, work_dir)
    model, ow, scheds = s.prepare(_net(), **EXPECTED[layout]['components'])
    fresh = _state(via, s, optimizer=False)[0]
    checkpoint = s.resume(str(Path(root) / EXPECTED[layout]['checkpoint']))
    rng = torch.rand(3)
    weights, optim = _state(via, s)
    return dict(
        iter=checkpoint['meta']['iter'],
        lr=[g['lr'] for g in ow.param_groups],
        scheduler_last_values=[sch.get_last_value() for sch in scheds],
        inner_count=ow.inner_count,
        weights=weights,
        optimizer=optim,
        rng=rng,
        fresh=fresh,
        rank=s.rank,
    )


@SCENARIOS.add('ranks')
def fsdp_on_two_ranks(root: str) -> dict:
    return _resume('fsdp', root, str(Path(root) / 'work_fsdp'))


@SCENARIOS.add('ranks')
def mid_window_on_two_ranks(root: str) -> dict:
    return {
        case: _resume_mid_window(case, root, str(Path(root) / f'work_{case}'))
        for case in PARTIAL_CASES
    }


@SCENARIOS.add('ranks')
def deepspeed_on_two_ranks(root: str) -> dict | None:
    if not _importable('deepspeed'):
        return None  # its test skips
    return _resume('deepspeed', root, str(Path(root) / 'work_deepspeed'))


def _mismatches(got: dict, want: dict, what: str) -> list[str]:
    """Each tensor of ``want`` (encoded) that ``got`` lacks or holds with another dtype,
    shape or any other bit; extra names in ``got`` too. [] when equal."""
    bad = [f'{what}: unexpected {k}' for k in sorted(set(got) - set(want))]
    for name, entry in want.items():
        if name not in got:
            bad.append(f'{what}: {name} missing')
            continue
        if set(entry) != {'dtype', 'shape', 'data'}:  # a nested dict (optimizer state)
            bad += _mismatches(got[name], entry, f'{what}[{name}]')
            continue
        a, b = got[name].detach().cpu(), _decode(entry)
        if a.dtype != b.dtype or a.shape != b.shape:
            bad.append(
                f'{what}: {name} is {a.dtype} {tuple(a.shape)}, expected {b.dtype} {tuple(b.shape)}'
            )
        elif not torch.equal(a, b):
            i = int((a.flatten() != b.flatten()).nonzero()[0])
            bad.append(
                f'{what}: {name} differs first at flat index {i}: got '
                f'{a.flatten()[i].item()!r}, expected {b.flatten()[i].item()!r}'
            )
    return bad


def _assert_resumed(layout: str, got: dict, rank: int = 0) -> None:
    want = EXPECTED[layout]
    # the fresh components held other weights: what follows was loaded
    assert _mismatches(got['fresh'], {k: want['weights'][k] for k in got['fresh']}, 'fresh')
    assert _mismatches(got['weights'], want['weights'], 'weights') == []
    assert _mismatches(got['optimizer'], want['optimizer'], 'optimizer') == []
    assert got['iter'] == want['iter'] == 3
    assert got['lr'] == want['lr']
    assert got['scheduler_last_values'] == want['scheduler_last_values']
    assert got['inner_count'] == want['inner_count'] == 3
    assert torch.equal(got['rng'], _decode(want['rng_after_save'][rank]))  # RNG state


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    root = tmp_path_factory.mktemp('legacy')
    _copy('fsdp', root)
    shutil.copytree(LEGACY / 'partial_grads', root / 'partial_grads')
    if _importable('deepspeed'):
        _copy('deepspeed', root)
    return SCENARIOS.run(request, root)


# --------------------------------------------------------------------- single file
def test_single_file_resumes_exactly(tmp_path):
    path = _copy('single', tmp_path)
    got = _resume('single', str(tmp_path), str(tmp_path / 'work'))
    _assert_resumed('single', got)
    assert sorted(p.name for p in (tmp_path / 'single').iterdir()) == [
        'iter_3.pth',
        'iter_3.pth.manifest.json',
    ]  # resume wrote nothing beside it
    assert path.is_file()


def test_single_file_loads_weights_and_verifies(tmp_path):
    from stratagem.checkpoint import verify_checkpoint

    path = _copy('single', tmp_path)
    manifest = verify_checkpoint(path)
    assert manifest is not None and manifest['step'] == 3 and manifest['kind'] == 'file'
    assert [f['path'] for f in manifest['files']] == ['iter_3.pth']
    s = _strategy('single', tmp_path / 'work')
    model = s.prepare(_net())
    checkpoint = s.load_checkpoint(str(path))
    assert checkpoint['meta']['iter'] == 3
    got = {k: v.detach() for k, v in model.state_dict().items()}
    assert _mismatches(got, EXPECTED['single']['weights'], 'weights') == []


# ---------------------------------------------------------------- FSDP directory
@pytest.mark.scenario('fsdp_on_two_ranks')
def test_fsdp_directory_resumes_exactly_on_two_ranks(scenario):
    for rank, out in enumerate(scenario):
        assert out['rank'] == rank
        _assert_resumed('fsdp', out, rank)


@pytest.mark.filterwarnings('ignore:.*re-seeded')  # 2 ranks' RNG streams into 1: by design
def test_fsdp_directory_resumes_in_one_process(tmp_path):
    _copy('fsdp', tmp_path)
    got = _resume('fsdp', str(tmp_path), str(tmp_path / 'work'), via='single')
    assert _mismatches(got['fresh'], EXPECTED['fsdp']['weights'], 'fresh')
    assert _mismatches(got['weights'], EXPECTED['fsdp']['weights'], 'weights') == []
    assert _mismatches(got['optimizer'], EXPECTED['fsdp']['optimizer'], 'optimizer') == []
    assert got['iter'] == 3 and got['inner_count'] == 3
    assert got['lr'] == EXPECTED['fsdp']['lr']
    assert got['scheduler_last_values'] == EXPECTED['fsdp']['scheduler_last_values']


def test_fsdp_directory_loads_in_one_process(tmp_path):
    from stratagem.checkpoint import verify_checkpoint

    path = _copy('fsdp', tmp_path)
    manifest = verify_checkpoint(path)
    assert manifest['kind'] == 'directory' and manifest['world_size'] == 2
    s = _strategy('single', tmp_path / 'work')
    model = s.prepare(_net())
    assert s.load_checkpoint(str(path))['meta']['iter'] == 3
    got = {k: v.detach() for k, v in model.state_dict().items()}
    assert _mismatches(got, EXPECTED['fsdp']['weights'], 'weights') == []


# ------------------------------------------------------------ DeepSpeed directory
@pytest.mark.scenario('deepspeed_on_two_ranks')
def test_deepspeed_directory_resumes_exactly_on_two_ranks(scenario):
    pytest.importorskip('deepspeed', reason=NO_DEEPSPEED)
    for rank, out in enumerate(scenario):
        assert out['rank'] == rank
        _assert_resumed('deepspeed', out, rank)
        # fp32 training: the master weights are the module's
        assert (
            _mismatches(
                {k: v['fp32'] for k, v in out['optimizer'].items()},
                EXPECTED['deepspeed']['weights'],
                'fp32 master',
            )
            == []
        )


def test_deepspeed_directory_converts_to_full_weights(tmp_path):
    pytest.importorskip('deepspeed', reason=NO_DEEPSPEED)
    from stratagem.checkpoint import verify_checkpoint
    from stratagem.cli import main

    path = _copy('deepspeed', tmp_path)
    assert verify_checkpoint(path)['world_size'] == 2
    converted = tmp_path / 'converted.pth'
    assert main(['convert', str(path), str(converted)]) == 0
    assert verify_checkpoint(converted)['step'] == 3
    s = _strategy('single', tmp_path / 'work')
    model = s.prepare(_net())
    assert s.load_checkpoint(str(converted))['meta']['iter'] == 3
    got = {k: v.detach() for k, v in model.state_dict().items()}
    assert _mismatches(got, EXPECTED['deepspeed']['weights'], 'weights') == []


def test_deepspeed_directory_loads_weights_in_single_device(tmp_path):
    """The one format detection (checkpoint.formats) lets any strategy's load_checkpoint read
    a DeepSpeed directory's full fp32 weights, verified, without converting it first."""
    pytest.importorskip('deepspeed', reason=NO_DEEPSPEED)
    path = _copy('deepspeed', tmp_path)
    s = _strategy('single', tmp_path / 'work')
    model = s.prepare(_net())
    assert s.load_checkpoint(str(path))['meta']['iter'] == 3
    got = {k: v.detach() for k, v in model.state_dict().items()}
    assert _mismatches(got, EXPECTED['deepspeed']['weights'], 'weights') == []


# --------------------------------------- mid-window checkpoints: format 1 partial gradients
class _TwoParts(nn.Module):
    """The generator's ``TwoParts``: each part's logits reach only its own parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        for_body = F.linear(h, self.head.weight.detach(), self.head.bias.detach())
        return for_body, self.head(h.detach())


def _mid_window_net(kind: str) -> nn.Module:
    """The generator's ``net`` with other weights (its seed is 0), so a load shows."""
    torch.manual_seed(1)
    if kind == 'two_parts':
        return _TwoParts()
    return nn.Sequential(OrderedDict(fc1=nn.Linear(4, 8), act=nn.Tanh(), fc2=nn.Linear(8, 2)))


def _mid_window_train(case: str, model: nn.Module, ow, it: int, rank: int, world: int) -> None:
    """Iteration ``it`` as the generator's ``train`` runs it, on its ``batch``."""
    g = torch.Generator().manual_seed(100 + it)
    x, y = torch.randn(8, 4, generator=g), torch.randint(2, (8,), generator=g)
    per = 8 // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    if case != 'ddp_dict':
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        ow.update_params(loss)
        return
    head, body = ow['head'], ow['body']
    with head.optim_context(model), body.optim_context(model):
        for_body, for_head = model(x)
    head.backward(head.scale_loss(F.cross_entropy(for_head, y)))
    body.backward(body.scale_loss(F.cross_entropy(for_body, y)))
    for wrapper in (head, body):
        if wrapper.should_update():
            wrapper.step()
            wrapper.zero_grad()


def _mid_window_state(s) -> tuple[dict, dict]:
    """(full weights, this rank's pending gradients), by parameter name, cloned."""
    if type(s).__name__ == 'FSDPStrategy':
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(s.model, options=StateDictOptions(full_state_dict=True))
        pending = s.pending_grads_part().pending() or {}  # FSDP2: unsharded, beside the shards
        return {k: v.detach().clone() for k, v in full.items()}, pending
    module = getattr(s.model, 'module', s.model)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return weights, grads


def _resume_mid_window(
    case: str, root: str, work_dir: str, via: dict | None = None, reverse_wrappers: bool = False
) -> dict:
    """Resume ``case``'s copy into fresh components (built by ``via``, a strategy cfg, by
    default the saving one's); the pending gradients right after, then (on the saving world
    size) the weights after training on to ``max_iters`` as the generator did."""
    from stratagem.strategies import build_strategy

    spec = PARTIAL[case]
    s = build_strategy(
        dict(
            via or spec['strategy'],
            work_dir=work_dir,
            env_kwargs=dict(randomness=dict(seed=7)),
        )
    )
    components = dict(spec['components'])
    if reverse_wrappers:  # the OptimWrapperDict's cfg lists its wrappers in the other order
        components['optim_wrapper'] = dict(reversed(list(components['optim_wrapper'].items())))
    model, ow = s.prepare(_mid_window_net(spec['model']), **components)
    fresh = _mid_window_state(s)[0]
    start = s.resume(str(Path(root) / spec['checkpoint']))['meta']['iter']
    weights, grads = _mid_window_state(s)
    wrappers = list(ow.values()) if hasattr(ow, 'values') else [ow]
    out = dict(
        rank=s.rank,
        iter=start,
        inner_count=[w.inner_count for w in wrappers],
        fresh=fresh,
        weights=weights,
        grads=grads,
    )
    if s.world_size == spec['world_size']:
        for it in range(start, spec['max_iters']):
            _mid_window_train(case, model, ow, it, s.rank, s.world_size)
        out['final'] = _mid_window_state(s)[0]
    return out


def test_mid_window_files_are_format_1():
    """What the files freeze: no format_version; the ranks' gradients per optim wrapper by
    optimizer index (wrapper 0 of the OptimWrapperDict holds the head: its index 0 is not
    the model's first parameter), FSDP's by name under ``partial_grads_fqn``."""
    for case in PARTIAL_CASES:
        checkpoint = torch.load(LEGACY / PARTIAL[case]['checkpoint'], weights_only=True)
        assert 'format_version' not in checkpoint['meta'], case
        if case == 'fsdp_full':
            assert 'partial_grads' not in checkpoint
            assert [sorted(g) for g in checkpoint['partial_grads_fqn']] == [
                sorted(g) for g in PARTIAL[case]['partial_grads']
            ]
            continue
        assert 'partial_grads_fqn' not in checkpoint
        index_names = PARTIAL[case]['index_names']
        per_rank = checkpoint['partial_grads']  # per rank, per wrapper
        assert len(per_rank) == 2 and all(len(entry) == len(index_names) for entry in per_rank)
        for entry in per_rank:
            for names, state in zip(index_names, entry):
                assert state['inner_count'] == 3
                assert sorted(state['grads']) == list(range(len(names)))  # optimizer indices
    assert PARTIAL['ddp_dict']['index_names'] == [
        ['head.weight', 'head.bias'],
        ['body.weight', 'body.bias'],
    ]


@pytest.mark.scenario('mid_window_on_two_ranks')
@pytest.mark.parametrize('case', PARTIAL_CASES)
def test_mid_window_resumes_exactly_on_two_ranks(scenario, case):
    want = PARTIAL[case]
    for rank, ranks in enumerate(scenario):
        got = ranks[case]
        assert got['rank'] == rank
        assert _mismatches(got['fresh'], want['weights_at_save'], 'fresh')  # other weights
        assert _mismatches(got['weights'], want['weights_at_save'], 'weights') == []
        assert got['iter'] == want['iter'] == 3
        assert got['inner_count'] == want['inner_count'] == [3] * len(want['index_names'])
        # this rank's own pending gradients, by name, bit for bit
        assert _mismatches(got['grads'], want['partial_grads'][rank], f'rank {rank} grads') == []
        # then trained on to max_iters: where the old code's resume (and an uninterrupted
        # run) ended
        assert _mismatches(got['final'], want['final_weights'], f'rank {rank} final') == []


@pytest.mark.filterwarnings('ignore:.*re-seeded')  # 2 ranks' RNG streams into 1: by design
@pytest.mark.parametrize('case', PARTIAL_CASES)
def test_mid_window_resumes_in_one_process_from_the_mean(tmp_path, case):
    _check_resumed_from_the_mean(tmp_path, case)


@pytest.mark.filterwarnings('ignore:.*re-seeded')
def test_mid_window_wrappers_pair_by_name_when_the_cfg_reorders_them(tmp_path):
    """Format 1 stored the OptimWrapperDict's gradients by position: a resume whose cfg lists
    the wrappers in the other order (body before head) still gives each its own, through the
    saved optimizer state's key order."""
    _check_resumed_from_the_mean(tmp_path, 'ddp_dict', reverse_wrappers=True)


def _check_resumed_from_the_mean(tmp_path, case: str, reverse_wrappers: bool = False) -> None:
    """World size 2 -> 1 (no micro batch size: the units are kept): the window continues
    from the mean of the saved ranks' pending gradients, what DDP would have averaged."""
    shutil.copytree(LEGACY / 'partial_grads', tmp_path / 'partial_grads')
    want = PARTIAL[case]
    single = dict(type='SingleDeviceStrategy', device='cpu')
    with pytest.warns(UserWarning, match="mean of the 2 ranks' partial gradients"):
        got = _resume_mid_window(
            case,
            str(tmp_path),
            str(tmp_path / 'work'),
            via=single,
            reverse_wrappers=reverse_wrappers,
        )
    assert _mismatches(got['weights'], want['weights_at_save'], 'weights') == []
    assert got['iter'] == 3 and got['inner_count'] == want['inner_count']
    saved = [{k: _decode(v) for k, v in grads.items()} for grads in want['partial_grads']]
    mean = {k: (saved[0][k] + saved[1][k]) / 2 for k in saved[0]}
    assert not any(torch.equal(mean[k], saved[0][k]) for k in mean)  # not rank 0's alone
    assert sorted(got['grads']) == sorted(mean)
    for name, grad in got['grads'].items():
        assert grad.dtype == mean[name].dtype and torch.equal(grad, mean[name]), name
