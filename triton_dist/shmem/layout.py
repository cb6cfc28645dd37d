"""The contract between the host heap and the device primitives.

A kernel receives one int64 tensor, the *context* of a group (``td.shmem.context(group)``)::

    ctx[0] = this rank's index in the group     ctx[1] = number of ranks in the group
    ctx[2] = wait budget (polls before ``dl.wait`` gives up and records an error)
    ctx[3] = heap offset of the group's barrier words: a count at +0, one arrival counter per rank at +256
    ctx[4 + r] = address of the heap of the group's rank r, as seen by this rank

The first ``RESERVED_BYTES`` of every heap belong to the runtime (the error record is per rank, for every group):

    +0    int32  error flag: 0 none, ERR_KIND_WAIT (a dl.wait timed out), ERR_KIND_INDEX (an index was refused)
    +4    int32  1 once a dl.wait of this rank gave up (its later waits give up at once)
    +8    int64  the rank's index in the group it failed in
    +16   int64  wait: heap offset of the signal      index: the bound (valid indices are [0, bound))
    +24   int64  wait: the value waited for         index: position of the bad element
    +32   int64  wait: the last value seen          index: its value
    +40   int64  wait: comparison code (CMP_CODES)  index: where (INDEX_SITES)
    +256  the default group's barrier words (count, then arrival counters at +512)
    +3968 int32  scratch word for ``dl.fence``
"""

CTX_RANK = 0
CTX_WORLD = 1
CTX_WAIT_BUDGET = 2
CTX_BARRIER = 3
CTX_BASES = 4

ERR_FLAG = 0
ERR_GAVE_UP = 4
ERR_RANK = 8
ERR_SIGNAL = 16
ERR_EXPECTED = 24
ERR_SEEN = 32
ERR_CMP = 40
ERR_KIND_WAIT = 1
ERR_KIND_INDEX = 2
BARRIER_COUNT = 256  # the default group's barrier words
BARRIER_ARRIVALS = 256  # arrival counters, relative to a group's barrier words
FENCE_SCRATCH = 3968
RESERVED_BYTES = 4096
MAX_RANKS = (FENCE_SCRATCH - BARRIER_COUNT - BARRIER_ARRIVALS) // 4

CMP_CODES = {"ge": 0, "eq": 1, "ne": 2, "gt": 3}
CMP_SYMBOLS = {0: ">=", 1: "==", 2: "!=", 3: ">"}
# Where a kernel refused an index (the code it records) and what the host names: (op, tensor).
SITE_BLOCK_TABLE, SITE_KV_LENS, SITE_EXPERT_IDS = 1, 2, 3
INDEX_SITES = {SITE_BLOCK_TABLE: ("sp_flash_decode", "block_table (a page id)"),
               SITE_KV_LENS: ("sp_flash_decode", "kv_lens (a sequence length)"),
               SITE_EXPERT_IDS: ("ep_dispatch", "topk_idx (an expert id)")}


CPU_POLLS_PER_SECOND = 1000  # CPU ranks: a wait budget of N polls means N milliseconds


def barrier_bytes(world):
    """Size of a group's barrier words."""
    return BARRIER_ARRIVALS + 4 * world
