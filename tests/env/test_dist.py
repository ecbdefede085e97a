"""Collectives and rank queries are correct no-ops in a single process."""

import pytest
import torch

from stratagem import env


def test_single_process_rank_queries(clean_env):
    clean_env['LOCAL_RANK'] = '3'  # ignored: no group, so this is the only process
    assert not env.is_distributed()
    assert (env.get_rank(), env.get_world_size(), env.get_dist_info()) == (0, 1, (0, 1))
    assert env.get_local_rank() == 0 and env.is_main_process()


def test_single_process_collectives_return_their_input():
    t = torch.tensor([1.0, 2.0])
    assert env.broadcast(t) is t and t.tolist() == [1.0, 2.0]
    obj = {'a': [1, 2]}
    assert env.broadcast_object(obj) is obj
    assert env.all_gather_object(obj) == [obj]
    for op in ('sum', 'mean', 'max', 'min', 'product', 'SUM'):
        assert env.all_reduce(t, op=op) is t and t.tolist() == [1.0, 2.0]
    assert env.all_reduce(torch.tensor([3])).tolist() == [3]
    assert env.barrier() is None


def test_all_reduce_rejects_bad_op_and_int_mean():
    with pytest.raises(ValueError, match="unknown reduce op 'avg'; valid ops: 'sum', 'mean'"):
        env.all_reduce(torch.ones(1), op='avg')
    with pytest.raises(TypeError, match="op='mean'.*torch.int64"):
        env.all_reduce(torch.ones(1, dtype=torch.int64), op='mean')


def test_master_only():
    calls = []

    @env.master_only
    def save(x):
        """Docstring kept."""
        calls.append(x)
        return x * 2

    assert save(4) == 8 and calls == [4]
    assert save.__name__ == 'save' and save.__doc__ == 'Docstring kept.'


def test_keys_in_one_process():
    from stratagem import env

    assert env.all_gather_keys([3, env.key_of(None)]) == [(3, -(1 << 63))]
    assert env.key_of(5) == 5 and env.key_of(-5) == -5
    assert env.key_of(True) != env.key_of(1)  # not an int: hashed
    assert env.key_of(1 << 70) == env.key_of(1 << 70) >= 1 << 62  # out of range: hashed
    assert env.key_of({'a': [1, 2]}) == env.key_of({'a': [1, 2]}) != env.key_of({'a': [2, 1]})
    assert env.key_of('x') != env.key_of('y')


def test_default_device(clean_env, monkeypatch):
    from stratagem.env import dist as env_dist

    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    clean_env['LOCAL_RANK'] = '1'
    assert env.default_device() == torch.device('cpu')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 2)
    monkeypatch.setattr(env_dist, 'is_distributed', lambda: True)
    assert env.default_device() == torch.device('cuda', 1)  # the launcher's LOCAL_RANK
    del clean_env['LOCAL_RANK']  # a host trainer that set the device itself
    assert env.default_device() == torch.device('cuda', 2)
