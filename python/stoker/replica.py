"""Model-parallel trainers: one batch per model replica.

With tensor, context, sequence or pipeline parallelism the ranks of one model replica must
train on the same batch; only the data-parallel coordinate selects a slice of the global
batch. :class:`stoker.Loader` takes the replica from a ``DeviceMesh`` (``mesh=``, ``dp_dims=``)
or from ``dp_rank`` / ``dp_size`` / ``replica_group``, and serves it one of two ways
(``replica_reads=``):

- ``"leader"`` (default): the replica's lowest rank holds the worker connections and
  broadcasts each batch (its metadata, then its payload as one byte tensor) to the others
  over a gloo group. The workers prepare each slice once.
- ``"each"``: every rank of the replica reads the same slice from the workers itself (no
  collective, any backend; the workers prepare each slice once per rank of the replica).

Either way every rank of a replica gets byte-identical batches and the same loader state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from . import _native
from ._native import ConfigError, StokerError

REPLICA_READS = ("leader", "each")

# The errors a leader's loader raises, by name, so that its followers raise the same.
_ERRORS = {
    name: getattr(_native, name)
    for name in ("BatchFailed", "ConfigError", "NoWorker", "PlanMismatch", "StokerError", "Unauthorized")
}


@dataclass(frozen=True)
class Replica:
    """This process's place: its data-parallel slice and the global ranks of its replica
    that share its reads (ascending; the first is the leader, which reads for them all)."""

    dp_rank: int
    dp_size: int
    ranks: Tuple[int, ...]

    @property
    def leader(self) -> int:
        return self.ranks[0]


def replica_in_mesh(ranks: Any, names: Sequence[str], dp_dims: Sequence[str], rank: int) -> Replica:
    """The replica of global ``rank`` in a mesh of global ranks ``ranks`` (an n-d array, as
    ``DeviceMesh.mesh``) whose dimensions are ``names``; the data-parallel coordinate is
    ``dp_dims``' coordinates flattened in the order given (row-major), every other dimension
    spans the replica."""
    ranks = np.asarray(ranks)
    names = list(names or ())
    dp_dims = list(dp_dims)
    if len(names) != ranks.ndim:
        raise ConfigError(
            f"the mesh has {ranks.ndim} dimensions but names {names}: build it with "
            "mesh_dim_names so that dp_dims can name the data-parallel ones"
        )
    unknown = [d for d in dp_dims if d not in names]
    if unknown or len(set(dp_dims)) != len(dp_dims):
        raise ConfigError(f"dp_dims {tuple(dp_dims)}: each must be one of the mesh's dimensions {tuple(names)}, once")
    dp_axes = [names.index(d) for d in dp_dims]
    rest = [a for a in range(ranks.ndim) if a not in dp_axes]
    dp_size = int(np.prod([ranks.shape[a] for a in dp_axes], dtype=np.int64))
    rows = np.transpose(ranks, dp_axes + rest).reshape(dp_size, -1)
    found = np.argwhere(rows == rank)
    if len(found) != 1:
        raise ConfigError(f"rank {rank} is not in the mesh {ranks.tolist()}")
    dp_rank = int(found[0][0])
    return Replica(dp_rank, dp_size, tuple(sorted(int(r) for r in rows[dp_rank])))


def replica_of_group(dp_rank: int, dp_size: int, group: Any, rank: int) -> Replica:
    """The replica given plainly: its slice and a process group holding its ranks (none:
    this process, global ``rank``, reads for itself)."""
    if not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank {dp_rank} is not in dp_size {dp_size}")
    if group is None:
        return Replica(dp_rank, dp_size, (rank,))
    import torch.distributed as dist

    ranks = tuple(sorted(dist.get_process_group_ranks(group)))
    if rank not in ranks:
        raise ConfigError(f"replica_group {list(ranks)} does not hold this process (rank {rank})")
    return Replica(dp_rank, dp_size, ranks)


def broadcast_group(replica: Replica, given: Any) -> Any:
    """The group a leader broadcasts on: ``given``, else a gloo group of the replica's ranks
    (made by them alone: other replicas make theirs, in any order)."""
    if given is not None:
        return given
    import torch.distributed as dist

    return dist.new_group(list(replica.ranks), backend="gloo", use_local_synchronization=True)


class Channel:
    """One replica's broadcast: a message (picklable metadata) and, with it, a payload."""

    def __init__(self, group: Any, leader: int) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.group = group
        self.leader = leader

    def send(self, message: Tuple, payload: Any = None) -> None:
        self._dist.broadcast_object_list([message], src=self.leader, group=self.group)
        if payload is not None:
            # A view of the received frame: broadcast reads it, nothing is copied.
            self._dist.broadcast(self._torch.frombuffer(payload, dtype=self._torch.uint8), src=self.leader, group=self.group)

    def receive(self) -> Tuple:
        box = [None]
        self._dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]

    def receive_payload(self, nbytes: int) -> np.ndarray:
        buf = self._torch.empty(nbytes, dtype=self._torch.uint8)
        self._dist.broadcast(buf, src=self.leader, group=self.group)
        return buf.numpy()


def _error_message(e: BaseException) -> Tuple:
    return ("error", type(e).__name__, str(e))


def _raise(message: Tuple, leader: int) -> None:
    _, name, text = message
    raise _ERRORS.get(name, StokerError)(f"{text} (replica leader rank {leader})")


class Leader:
    """The native loader of a replica's leader, sending every result to the followers."""

    def __init__(self, native: Any, channel: Channel) -> None:
        self._native = native
        self._channel = channel
        channel.send(("ready", native.state(), native.plan()))

    @staticmethod
    def failed(channel: Channel, e: BaseException) -> None:
        """The leader's loader could not start: the followers raise the same error."""
        channel.send(_error_message(e))

    def next_batch(self) -> Dict[str, Any]:
        before = self._native.state()
        try:
            raw = self._native.next_batch()
        except StopIteration:
            self._channel.send(("end", before, self._native.state()))
            raise
        except StokerError as e:
            self._channel.send(_error_message(e))
            raise
        meta = {k: v for k, v in raw.items() if k != "payload"}
        meta["nbytes"] = len(raw["payload"])
        self._channel.send(("batch", before, self._native.state(), meta), raw["payload"])
        return raw

    def load_state(self, plan_id: int, epoch: int, next_batch: int) -> None:
        try:
            self._native.load_state(plan_id, epoch, next_batch)
        except StokerError as e:
            self._channel.send(_error_message(e))
            raise
        self._channel.send(("loaded", (plan_id, epoch, next_batch)))

    def __getattr__(self, name: str) -> Any:
        # state, plan, stats, metrics_addr: the leader's own.
        return getattr(self._native, name)


class Follower:
    """A replica rank without worker connections: the leader's batches, as the native
    loader's interface gives them."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        message = channel.receive()
        if message[0] != "ready":
            _raise(message, channel.leader)
        _, self._state, self._plan = message
        self._wait_s = 0.0
        self._step_s = 0.0
        self._batches = 0
        self._samples = 0
        self._returned: Optional[float] = None

    def next_batch(self) -> Dict[str, Any]:
        start = time.monotonic()
        if self._returned is not None:
            self._step_s += start - self._returned
        try:
            message = self._channel.receive()
            kind = message[0]
            if kind == "error":
                _raise(message, self._channel.leader)
            if kind not in ("batch", "end") or tuple(message[1]) != tuple(self._state):
                raise StokerError(
                    f"replica out of step: at {tuple(self._state)} this rank got the leader's "
                    f"{kind} from {message[1] if kind in ('batch', 'end') else '-'} (every rank of "
                    "a replica must iterate, load_state_dict and stop together)"
                )
            self._state = message[2]
            if kind == "end":
                raise StopIteration
            raw = dict(message[3])
            raw["payload"] = self._channel.receive_payload(raw.pop("nbytes"))
            self._batches += 1
            self._samples += len(raw["sample_ids"])
            return raw
        finally:
            self._returned = time.monotonic()
            self._wait_s += self._returned - start

    def state(self) -> Tuple[int, int, int]:
        return tuple(self._state)

    def load_state(self, plan_id: int, epoch: int, next_batch: int) -> None:
        wanted = (plan_id, epoch, next_batch)
        message = self._channel.receive()
        if message[0] == "error":
            _raise(message, self._channel.leader)
        if message[0] != "loaded" or tuple(message[1]) != wanted:
            raise StokerError(
                f"replica out of step: this rank loads {wanted} but the leader sent {message[:2]}"
            )
        self._state = wanted

    def plan(self) -> Dict[str, Any]:
        return dict(self._plan)

    def stats(self) -> Dict[str, float]:
        busy = self._wait_s + self._step_s
        return {
            "wait_s": self._wait_s,
            "step_s": self._step_s,
            "wait_ratio": self._wait_s / busy if busy > 0 else 0.0,
            "batches": self._batches,
            "samples": self._samples,
        }

    def metrics_addr(self) -> Optional[str]:
        return None

