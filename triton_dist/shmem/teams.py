"""Groups of ranks on the one symmetric heap of a process: a *team* is a ``torch.distributed`` group seen as a view
of the heap — its size, this rank's index in it, its members' heap bases in group order, its own barrier words —
packed into the context tensor its kernels take (``layout.py``). Teams are made once per group, collectively
among its members, on first use (``shmem.context(group)``); the group ``triton_dist.init`` was given is the
default team.

Members agree through the ``torch.distributed`` store, not a collective of the group: ``Team.agree`` publishes
what this rank is doing (an allocation, an op call) and reads what every member published for the same step.
Each team counts its steps, so members that take the same steps read each other's; a member that does something
else is named in a ``CollectiveMismatchError`` on every rank, one that never comes within the wait timeout too.
"""

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from . import layout
from .errors import CollectiveMismatchError

STORE_PREFIX = "triton_dist"


class Team:
    """The ranks of one group on the heap. ``heap_ranks[i]``: the heap rank of the group's rank i."""

    def __init__(self, rt, group, name, heap_ranks, barrier_offset):
        self.group, self.name, self.heap_ranks = group, name, list(heap_ranks)
        self.size = len(self.heap_ranks)
        self.rank = self.heap_ranks.index(rt.rank)
        self.steps = 0  # agreements so far: every member counts the same
        self.generation = 0  # resets so far: a reset starts the steps afresh under new store keys
        self.barrier_offset = barrier_offset
        self.ctx = torch.tensor([self.rank, self.size, rt.wait_polls, barrier_offset]
                                + [rt.heap.bases[h] for h in self.heap_ranks], dtype=torch.int64,
                                device=rt.heap.device)
        self.barrier_words = None  # a non-default team's words, a symmetric tensor (reset zeroes it)

    def agree(self, rt, what, value):
        """Every member's ``(what, value)`` for this step, in group order; CollectiveMismatchError on every rank
        when a member is doing something else (another ``what``) or does not come within the wait timeout."""
        self.steps += 1
        if self.size == 1:
            return [value]
        store = dist.distributed_c10d._get_default_store()
        prefix = f"{STORE_PREFIX}/{self.name}/{self.generation}/{self.steps}/"
        store.set(prefix + str(self.rank), pickle.dumps((what, value)))
        keys = [prefix + str(r) for r in range(self.size)]
        try:
            store.wait(keys, timedelta(seconds=rt.wait_timeout_s))
        except Exception:  # a store's timeout (its type differs between torch versions)
            late = [r for r in range(self.size) if not store.check([keys[r]])]
            raise CollectiveMismatchError(
                f"rank {rt.rank}: {self.describe(late)} did not reach {what} within {rt.wait_timeout_s:g} s "
                f"(did every rank of the group make this call? triton_dist.shmem.reset() brings the ranks back in "
                f"step)") from None
        entries = [pickle.loads(store.get(k)) for k in keys]
        if self.steps > 1:  # every member read our previous step's entry before it wrote this step's
            try:
                store.delete_key(f"{STORE_PREFIX}/{self.name}/{self.generation}/{self.steps - 1}/{self.rank}")
            except Exception:  # a store without deletion keeps the keys: harmless
                pass
        others = sorted({repr(e[0]) for e in entries} - {repr(what)})
        if others:
            doing = "; ".join(f"rank {self.heap_ranks[r]}: {e[0]}" for r, e in enumerate(entries))
            raise CollectiveMismatchError(f"rank {rt.rank}: ranks of {self.describe()} made different calls: {doing}")
        return [e[1] for e in entries]

    def restart(self):
        """After a collective reset: every member starts counting its steps again, under new store keys."""
        self.generation += 1
        self.steps = 0

    def describe(self, members=None):
        """"group <name> (ranks ...)", or the listed members' heap ranks."""
        if members is not None:
            return "ranks " + ", ".join(str(self.heap_ranks[r]) for r in members) + f" of group {self.name}"
        return f"group {self.name} (ranks {self.heap_ranks})"


def group_key(group):
    """What identifies a torch.distributed group on every member: its name. (isinstance, not hasattr: torch
    2.11's dynamo traces the one and not the other inside a compiled function.)"""
    return group.group_name if isinstance(group, dist.ProcessGroup) else str(id(group))


def heap_ranks_of(rt, group):
    """The heap rank of each of ``group``'s ranks (group order); ValueError if a member is not on the heap."""
    members = dist.get_process_group_ranks(group)
    heap_members = dist.get_process_group_ranks(rt.group)
    missing = [g for g in members if g not in heap_members]
    if missing:
        raise ValueError(f"group {group_key(group)} has ranks {missing} that are not on triton_dist's heap "
                         f"(the group triton_dist.init was given spans ranks {heap_members})")
    if dist.get_rank() not in members:
        raise ValueError(f"rank {dist.get_rank()} is not a member of group {group_key(group)} (ranks {members})")
    return [heap_members.index(g) for g in members]


def default_team(rt):
    return Team(rt, rt.group, "default", range(rt.world), layout.BARRIER_COUNT)
