"""Host side: the symmetric heap, groups of ranks on it, peer views, barrier, what ops reuse, and the errors."""

from .errors import (CollectiveMismatchError, DeviceIndexError, HeapExhaustedError,  # noqa: F401
                     NotInitializedError, WaitTimeoutError)
from .heap import (  # noqa: F401
    agree_on_call,
    backend,
    barrier,
    check_calls,
    check_device,
    check_errors,
    check_symmetric,
    clear_errors,
    context,
    counters,
    device,
    empty,
    finalize,
    group,
    group_name,
    group_named,
    init,
    is_initialized,
    is_symmetric,
    op_team,
    peer_view,
    peer_views,
    raise_pending_errors,
    rank,
    reset,
    set_wait_timeout,
    signals,
    team,
    world_size,
    zeros,
)
from .workspaces import Plans, release_workspaces, workspace  # noqa: F401
