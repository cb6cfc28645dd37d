"""What op calls reuse: workspaces (symmetric buffers and signals, built collectively) and plans (local).

    buffers = workspace("ag_gemm", (m, k, dtype), lambda: Buffers(m, k, dtype))
    plan = PLANS.get(key, lambda: Plan(...))                     # PLANS = Plans("ag_gemm"), one per op

* A workspace belongs to an op, a key and a group. It is built on first use, by every rank of the group in the
  same order (its symmetric allocations are collective over the group), then a barrier: peers signal into its
  flags only once every rank has zeroed them. It cannot be built during a CUDA-graph capture (RuntimeError naming
  the op: call the op once before capturing). ``fits`` lets an op grow a workspace: one that no longer fits is
  replaced, and the op's plans and graphs, which may hold it, are dropped.
* A plan holds what a call derives from its shapes and config (tuned config, grid, views, descriptors). It is
  built locally; one built during a capture or a torch.compile trace is used but not kept (no tuning ran there).
* ``release_workspaces()`` (collective) drops every workspace, plan and captured graph of every op.
"""

from .. import hardware
from .heap import barrier, is_initialized, on_heap_drop, team

_WORKSPACES = {}  # (op, key) -> workspace
_CACHES = {}  # op -> [plan caches and graph caches: anything with .clear()]


def register(op, cache):
    """Have ``release_workspaces`` (and a replaced workspace of ``op``) clear ``cache``; returns it."""
    _CACHES.setdefault(op, []).append(cache)
    return cache


def workspace(op, key, build, fits=None, group=None):
    """The workspace of ``op`` for ``key`` on ``group``: ``build()`` on first use (collective over the group; it
    allocates with ``group=``), then the same object."""
    key = (team(group).name, key)
    ws = _WORKSPACES.get((op, key))
    if ws is not None and (fits is None or fits(ws)):
        return ws
    if hardware.capturing():
        raise RuntimeError(f"{op}: the first call for this shape happens during CUDA-graph capture; call it once "
                           f"before capturing (workspaces are allocated and zeroed collectively)")
    if ws is not None:  # outgrown: whatever captured the old buffers goes with them
        del _WORKSPACES[(op, key)], ws
        _clear(op)
    ws = build()
    barrier(group)  # peers signal into the new flags only after every rank zeroed them
    _WORKSPACES[(op, key)] = ws
    return ws


def peek(op, key, group=None):
    """The workspace of ``op`` for ``key`` on ``group`` if one was built, else None (never builds)."""
    return _WORKSPACES.get((op, (team(group).name, key)))


def cached(op):
    """Every workspace of ``op`` built so far (tests poison them before a call)."""
    return [ws for (name, _), ws in _WORKSPACES.items() if name == op]


class Plans:
    """One op's plans, keyed by what they depend on; at most ``limit`` (then the cache starts over)."""

    def __init__(self, op, limit=256):
        self.limit = limit
        self._plans = {}
        register(op, self)

    def get(self, key, build):
        plan = self._plans.get(key)
        if plan is None:
            plan = build()
            if not (hardware.capturing() or hardware.compiling()):
                if len(self._plans) >= self.limit:
                    self._plans.clear()
                self._plans[key] = plan
        return plan

    def find(self, key):
        """The plan of ``key``, or None."""
        return self._plans.get(key)

    def clear(self):
        self._plans.clear()


def _clear(op=None):
    for name, caches in _CACHES.items():
        if op is None or name == op:
            for cache in caches:
                cache.clear()


def release_workspaces():
    """Free every op's cached workspaces, plans and CUDA graphs. Collective: every rank calls it at the same point
    (after a barrier, so that no peer still writes into the buffers); later calls build them again."""
    if is_initialized():
        barrier()
    forget_all()


@on_heap_drop
def forget_all():
    """Drop every cache without a barrier (the heap is going away: ``finalize``, ``reset``)."""
    _clear()
    _WORKSPACES.clear()
