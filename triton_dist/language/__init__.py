"""Device-side tile primitives: ``import triton_dist.language as dl``.

Every primitive is an ordinary ``@triton.jit`` function, callable from any Triton kernel. A kernel that talks to
other ranks takes one extra argument, the context ``ctx = td.shmem.context()`` (an int64 tensor holding this rank,
the number of ranks and every rank's heap address), and passes it on.

Memory-ordering contract (the same on GPUs and under the interpreter):

* ``put`` / ``get`` are plain (weak) stores / loads to or from a peer's copy of a symmetric tensor.
* ``signal`` first makes every earlier store of the *whole program* (all its threads) visible, then writes the
  flag with release semantics at system scope. A peer that ``wait``-s for that value and sees it is guaranteed to
  see those stores (release/acquire pairing).
* ``wait`` polls with acquire semantics; after it returns, every thread of the program may read what the signaller
  wrote before signalling. It is bounded: after ``ctx[2]`` polls it records which rank waited on which signal in
  the heap's error record and returns, so a lost signal surfaces as ``td.shmem.WaitTimeoutError`` on the host
  instead of a hang.
* Flags are int32 counters compared wrap-safely (``ge``/``gt`` look at the signed difference), so monotonically
  growing *epochs* work forever: a call with epoch ``e`` signals ``e`` and waits for ``>= e`` — no resets, no
  host memsets, CUDA-graph replay safe. ``call_epoch`` / ``finish_call`` keep such a counter on the device.
"""

from .primitives import (  # noqa: F401
    ADD,
    EQ,
    GE,
    GT,
    NE,
    SET,
    arrive_last,
    barrier_all,
    bulk_stores_done,
    call_epoch,
    check_index,
    enter_call,
    fence,
    finish_call,
    get,
    launch_dependents,
    num_ranks,
    put,
    rank,
    rank_lanes,
    signal,
    symm_at,
    timestamp,
    wait,
    wait_entered,
    wait_prior_kernel,
)
