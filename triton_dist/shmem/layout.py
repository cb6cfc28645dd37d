"""The contract between the host heap and the device primitives.

A kernel receives one int64 tensor, the *context* (``td.shmem.context()``)::

    ctx[0] = rank            ctx[1] = number of ranks
    ctx[2] = wait budget     (polls before ``dl.wait`` gives up and records an error)
    ctx[3] = reserved
    ctx[4 + r] = address of rank r's heap, as seen by this rank

The first ``RESERVED_BYTES`` of every heap belong to the runtime:

    +0    int32  error flag (0: none; the first timed-out wait sets it to 1)
    +8    int64  rank that timed out
    +16   int64  heap offset of the signal it waited on
    +24   int64  value it waited for
    +32   int64  last value it saw
    +40   int64  comparison code (see ``CMP_CODES``)
    +256  int32  count of in-kernel barriers this rank has entered
    +512  int32  barrier arrival counters, one per peer
    +3968 int32  scratch word for ``dl.fence``
"""

CTX_RANK = 0
CTX_WORLD = 1
CTX_WAIT_BUDGET = 2
CTX_BASES = 4

ERR_FLAG = 0
ERR_RANK = 8
ERR_SIGNAL = 16
ERR_EXPECTED = 24
ERR_SEEN = 32
ERR_CMP = 40
BARRIER_COUNT = 256
BARRIER_FLAGS = 512
FENCE_SCRATCH = 3968
RESERVED_BYTES = 4096
MAX_RANKS = (FENCE_SCRATCH - BARRIER_FLAGS) // 4

CMP_CODES = {"ge": 0, "eq": 1, "ne": 2, "gt": 3}
CMP_SYMBOLS = {0: ">=", 1: "==", 2: "!=", 3: ">"}
