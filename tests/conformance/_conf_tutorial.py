"""The scripts of pytorch/tutorials intermediate_source/dist_tuto.rst ("Writing
Distributed Applications with PyTorch"), each ``run(rank, size)`` kept as written there
with only the import (``dist``) and the array type changed: ``torch.zeros(1)`` becomes
``zeros(1)`` (``np.zeros(1, np.float32)`` on gpucoll) and ``t.clone()`` becomes
``clone(t)`` (``t.copy()``), because a NumPy array has no ``clone`` method. The
tutorial's ``print`` lines become asserts of the values it says each rank prints.
"""

from __future__ import annotations

from random import Random

from _conf_core import Impl, eq, section

TUT = "pytorch/tutorials intermediate_source/dist_tuto.rst"
S = section("tutorial", world_sizes=(2, 4), pg_timeout=15.0, timeout=90.0)


def _names(T: Impl) -> tuple:
    zeros = (lambda n: T.torch.zeros(n)) if T.is_torch else (lambda n: T.zeros(n))
    ones = (lambda n: T.torch.ones(n)) if T.is_torch else (lambda n: T.full(n, 1.0))
    clone = (lambda t: t.clone()) if T.is_torch else (lambda t: t.copy())
    return T.dist, zeros, ones, clone


@S.check(f"{TUT} 'Blocking point-to-point communication'", world_sizes=(2,))
def check_tutorial_blocking_p2p(T: Impl) -> None:
    dist, zeros, _, _ = _names(T)
    rank = T.rank
    tensor = zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    else:
        dist.recv(tensor=tensor, src=0)
    assert tensor[0] == 1.0, tensor


@S.check(f"{TUT} 'Non-blocking point-to-point communication'", world_sizes=(2,))
def check_tutorial_nonblocking_p2p(T: Impl) -> None:
    dist, zeros, _, _ = _names(T)
    rank = T.rank
    tensor = zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        req = dist.isend(tensor=tensor, dst=1)
    else:
        req = dist.irecv(tensor=tensor, src=0)
    req.wait()
    assert tensor[0] == 1.0, tensor


@S.check(f"{TUT} 'All-Reduce example' (new_group([0, 1]) and dist.reduce_op.SUM)")
def check_tutorial_all_reduce_group(T: Impl) -> None:
    dist, _, ones, _ = _names(T)
    group = dist.new_group([0, 1])
    tensor = ones(1)
    if T.rank in (0, 1):  # the tutorial runs with size 2; other ranks are not members
        dist.all_reduce(tensor, op=dist.reduce_op.SUM, group=group)
        assert tensor[0] == 2.0, tensor


@S.check(f"{TUT} 'All-Reduce example' with dist.ReduceOp.SUM (the current spelling)")
def check_tutorial_all_reduce_group_reduceop(T: Impl) -> None:
    dist, _, ones, _ = _names(T)
    group = dist.new_group([0, 1])
    tensor = ones(1)
    if T.rank in (0, 1):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        assert tensor[0] == 2.0, tensor


@S.check(f"{TUT} 'Our Own Ring-Allreduce'")
def check_tutorial_ring_allreduce(T: Impl) -> None:
    dist, zeros, _, clone = _names(T)

    def allreduce(send, recv):
        rank = dist.get_rank()
        size = dist.get_world_size()
        send_buff = clone(send)
        recv_buff = clone(send)
        accum = clone(send)

        left = ((rank - 1) + size) % size
        right = (rank + 1) % size

        for i in range(size - 1):
            if i % 2 == 0:
                send_req = dist.isend(send_buff, right)
                dist.recv(recv_buff, left)
                accum[:] += recv_buff[:]
            else:
                send_req = dist.isend(recv_buff, right)
                dist.recv(send_buff, left)
                accum[:] += send_buff[:]
            send_req.wait()
        recv[:] = accum[:]

    send = zeros(3)
    send += T.rank + 1
    recv = zeros(3)
    allreduce(send, recv)
    eq(recv, [sum(range(1, T.ws + 1))] * 3, T)


@S.check(f"{TUT} 'Distributed Training' (DataPartitioner + average_gradients, without a model)")
def check_tutorial_average_gradients(T: Impl) -> None:
    dist, zeros, _, _ = _names(T)

    class Partition(object):
        def __init__(self, data, index):
            self.data = data
            self.index = index

        def __len__(self):
            return len(self.index)

        def __getitem__(self, index):
            return self.data[self.index[index]]

    class DataPartitioner(object):
        def __init__(self, data, sizes=[0.7, 0.2, 0.1], seed=1234):
            self.data = data
            self.partitions = []
            rng = Random()
            rng.seed(seed)
            data_len = len(data)
            indexes = [x for x in range(0, data_len)]
            rng.shuffle(indexes)
            for frac in sizes:
                part_len = int(frac * data_len)
                self.partitions.append(indexes[0:part_len])
                indexes = indexes[part_len:]

        def use(self, partition):
            return Partition(self.data, self.partitions[partition])

    size = dist.get_world_size()
    data = list(range(40))
    part = DataPartitioner(data, [1.0 / size for _ in range(size)]).use(dist.get_rank())
    # a "gradient" per rank: the mean of its partition; averaged as in average_gradients
    grad = zeros(1)
    grad += sum(part[i] for i in range(len(part))) / len(part)
    dist.all_reduce(grad, op=dist.reduce_op.SUM)
    grad /= float(size)
    parts = [DataPartitioner(data, [1.0 / size] * size).use(r) for r in range(size)]
    ref = sum(sum(p[i] for i in range(len(p))) / len(p) for p in parts) / size
    assert abs(float(grad[0]) - ref) < 1e-4, (grad, ref)
