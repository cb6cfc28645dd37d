"""How the programs of the MoE kernels share work and publish chunks, and why they cannot deadlock.

Work claims: senders take token chunks in order from a per-call counter (``claims[1]``), receivers take units
(chunk, column part) in order from another (``claims[0]``), so faster programs take more. Every claimer's last
claim fails; the call's very last one resets the counter on the device for the next call.

Chunk flags: once a sender has sent chunk c it raises ``flags[me, c] = epoch`` on every peer (a release: the
chunk's stores are visible first); with DEFER_SIGNAL only after it has started its next chunk, when the chunk's
stores have drained and the release costs nothing.

No deadlock, on GPUs and under the interpreter (which runs the programs of a launch one after another): a program
never waits on a later program of its own rank. Senders precede receivers; senders wait only for the counts,
which the layout launch (or program 0) publishes; the layout looks back at earlier programs only. Senders help
the receivers (SENDERS_HELP) only on a GPU with every program resident at once, so a waiting sender never keeps
a peer's sender off the GPU.

Phase timeline (``timeline=``, GPU only): GPU-clock ns at phase boundaries, for tuning. Program p:
[TL_PROGRAM + 4p + i], i = 0 start, 1 counts known (dispatch) / sending starts (combine senders), 2 all chunks
sent (senders) / expert ids marked (dispatch receivers), 3 end. Chunk c: [TL_CHUNK + 4c + i], i = 0 sent and
flagged, 1 its flags seen by a receiver, 2 received. Layout program g: [TL_LAYOUT + 4g + i], i = 0 start,
1 counted, 2 prefix known, 3 end.
"""

import triton
import triton.language as tl

from ... import language as dl

MAX_CHUNKS = 1024  # flags and chunk tables are sized for this many token chunks per call
MAX_TIMELINE_PROGRAMS = 512
TL_PROGRAM = tl.constexpr(0)
TL_CHUNK = tl.constexpr(4 * MAX_TIMELINE_PROGRAMS)
TL_LAYOUT = tl.constexpr(4 * MAX_TIMELINE_PROGRAMS + 4 * MAX_CHUNKS)
TIMELINE_SLOTS = 4 * MAX_TIMELINE_PROGRAMS + 8 * MAX_CHUNKS


@triton.jit
def stamp(timeline, slot, ON: tl.constexpr):
    """timeline[slot] = now (GPU clock, ns) when the phase timeline is on."""
    if ON:
        tl.store(timeline + slot, dl.timestamp())


# ----------------------------------------------------------------------------------------------------- flags
@triton.jit
def flag_chunk(flags, c, epoch, ctx, timeline, MAXC: tl.constexpr, TIMELINE: tl.constexpr):
    """Raise flags[me, c] = epoch on every peer (after every earlier store of this program: dl.signal's release)
    and stamp the chunk as sent."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    for i in range(world - 1):
        dl.signal(flags + me * MAXC + c, epoch, (me + 1 + i) % world, ctx)
    stamp(timeline, TL_CHUNK + 4 * c, TIMELINE)


@triton.jit
def flag_pending(flags, pending, epoch, ctx, timeline, MAXC: tl.constexpr, TIMELINE: tl.constexpr):
    """Raise the flags of chunk ``pending`` if there is one (>= 0); the new pending chunk: none (-1)."""
    if pending >= 0:
        flag_chunk(flags, pending, epoch, ctx, timeline, MAXC, TIMELINE)
    return tl.full((), -1, tl.int32)


@triton.jit
def chunk_sent(flags, c, pending, epoch, ctx, timeline, MAXC: tl.constexpr, TIMELINE: tl.constexpr,
               DEFER_SIGNAL: tl.constexpr):
    """A sender has sent chunk ``c``: raise the flags of a chunk still pending (a chunk without tokens came
    between, so nothing flagged it), then those of ``c`` now, or with DEFER_SIGNAL once the next chunk is under
    way. Returns the pending chunk (-1: none)."""
    pending = flag_pending(flags, pending, epoch, ctx, timeline, MAXC, TIMELINE)
    if DEFER_SIGNAL:
        pending = c
    else:
        flag_chunk(flags, c, epoch, ctx, timeline, MAXC, TIMELINE)
    return pending


# ----------------------------------------------------------------------------------------------------- claims
@triton.jit
def first_claim(claims, pid, n_prog, n_push, n_units, SENDERS_HELP: tl.constexpr):
    """Receivers (and with SENDERS_HELP the senders, programs [0, n_push)) take units of work in order from a
    per-call counter: (this program's first unit, number of programs taking part). A program that takes no part
    gets ``n_units + claimers`` (none)."""
    claimers = n_prog if SENDERS_HELP else n_prog - n_push
    u = n_units + claimers
    if SENDERS_HELP or pid >= n_push:
        u = tl.atomic_add(claims, 1, sem="relaxed", scope="gpu")
    return u, claimers


@triton.jit
def count_units(n_chunks, h_parts, tail, tail_parts):
    """Units of the receivers' work (see ``receiver_unit``)."""
    return (n_chunks - tail) * h_parts + tail * tail_parts


@triton.jit
def receiver_unit(u, n_chunks, h_parts, tail, tail_parts, H, BH: tl.constexpr):
    """Unit ``u`` of the receivers' work: (chunk, first column, end column). A chunk's columns come in h_parts
    parts of whole BH tiles (the last part may be short or empty), those of the last ``tail`` chunks in
    tail_parts: finer units there shorten the work left once the last chunk lands."""
    n_head = (n_chunks - tail) * h_parts
    head = u < n_head
    v = tl.maximum(u - n_head, 0)
    parts = tl.where(head, h_parts, tail_parts)
    part = tl.where(head, u % h_parts, v % tail_parts)
    part_h = tl.cdiv(tl.cdiv(H, BH), parts) * BH
    h_first = part * part_h
    return tl.where(head, u // h_parts, n_chunks - tail + v // tail_parts), h_first, tl.minimum(h_first + part_h, H)


@triton.jit
def next_claim(claims):
    return tl.atomic_add(claims, 1, sem="relaxed", scope="gpu")


@triton.jit
def end_claims(claims, u, n_units, claimers):
    """``u``: this program's failed claim. The call's last claim (every claimer's last one fails) resets the
    counter for the next call."""
    if u == n_units + claimers - 1:
        tl.atomic_xchg(claims, 0, sem="relaxed", scope="gpu")
