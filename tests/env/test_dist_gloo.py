"""Two ranks on gloo, started as torchrun starts them: one spawn checks all of env/'s dist.

The worker returns what it saw; the assertions run here, in the test, with pytest's messages.
"""

from dist_harness import run_distributed


def two_rank_checks():
    import logging

    import torch
    import torch.distributed as dist

    from stratagem import env

    seen = {'launcher': env.infer_launcher(), 'before_init': env.get_dist_info()}
    env.init_dist('pytorch', timeout=30)
    rank = env.get_rank()
    seen.update(
        backend=dist.get_backend(),
        dist_info=env.get_dist_info(),
        local_rank=env.get_local_rank(),
        main=env.is_main_process(),
        distributed=env.is_distributed(),
        object=env.broadcast_object({'from': rank, 'items': [rank] * 3} if rank == 0 else None),
        gathered=env.all_gather_object(('rank', rank)),
        sum=env.all_reduce(torch.tensor([rank + 1.0, 10.0])).tolist(),
        mean=env.all_reduce(torch.tensor([rank + 1.0]), op='mean').tolist(),
        max=env.all_reduce(torch.tensor([rank]), op='max').tolist(),
        broadcast=env.broadcast(torch.tensor([rank + 5]), src=1).tolist(),
        master_only=env.master_only(lambda: 'saved')(),
        logger_level=env.get_logger('stratagem').level,
    )
    # Seeds: None is drawn on rank 0 and shared; diff_rank_seed offsets by the rank.
    seen['seed'] = env.set_random_seed(None)
    seen['first_draw'] = torch.rand(1).item()
    seen['rank_seed'] = env.set_random_seed(100, diff_rank_seed=True)
    env.barrier()

    # A second init_dist (a host trainer already made the group) must not re-initialise.
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    launcher_logger = logging.getLogger('stratagem.env.launcher')
    launcher_logger.addHandler(handler)
    launcher_logger.setLevel(logging.INFO)
    group = dist.group.WORLD
    env.init_dist('pytorch')
    seen['same_group'] = dist.group.WORLD is group
    seen['reinit_log'] = [r.getMessage() for r in records]
    seen['after_reinit'] = env.all_gather_object(rank)
    # the small-key gather the resume checks use, and the step check built on it
    seen['keys'] = env.all_gather_keys(
        [
            rank,
            env.key_of('same'),
            env.key_of(None),
            env.key_of({'size': 3, 'digest': 'ab' * (rank + 1)}),
        ]
    )
    from stratagem.strategies.loading import check_same_step

    check_same_step(7, 'ck')  # equal: returns
    try:
        check_same_step(5 + rank, 'ck')
    except RuntimeError as err:
        seen['step_disagreement'] = str(err)
    return seen


def test_two_ranks_on_gloo():
    results = run_distributed(two_rank_checks, nproc=2, timeout=90)
    for rank, seen in enumerate(results):
        assert seen['launcher'] == 'pytorch' and seen['before_init'] == (0, 1)
        assert seen['backend'] == 'gloo' and seen['distributed']
        assert seen['dist_info'] == (rank, 2) and seen['local_rank'] == rank
        assert seen['main'] == (rank == 0)
        assert seen['object'] == {'from': 0, 'items': [0, 0, 0]}
        assert seen['gathered'] == [('rank', 0), ('rank', 1)]
        assert seen['sum'] == [3.0, 20.0] and seen['mean'] == [1.5] and seen['max'] == [1]
        assert seen['broadcast'] == [6]
        assert seen['master_only'] == ('saved' if rank == 0 else None)
        assert seen['logger_level'] == (20 if rank == 0 else 30)  # INFO / WARNING
        assert seen['rank_seed'] == 100 + rank
        assert seen['same_group'] and seen['after_reinit'] == [0, 1]
        assert len(seen['reinit_log']) == 1 and 'already initialised' in seen['reinit_log'][0]
    keys = results[0]['keys']
    assert keys == results[1]['keys'] and [k[0] for k in keys] == [0, 1]
    assert keys[0][1] == keys[1][1]  # equal values, equal keys
    assert keys[0][2] == keys[1][2] == -(1 << 63)  # None
    assert keys[0][3] != keys[1][3]  # the dicts differ
    for seen in results:
        assert seen['step_disagreement'] == (
            'after resuming ck the ranks disagree on the '
            'iteration: [5, 6] (rank order); every rank must '
            'resume the same checkpoint'
        )
    assert results[0]['seed'] == results[1]['seed']
    assert results[0]['first_draw'] == results[1]['first_draw']
