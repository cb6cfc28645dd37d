"""RankPool's stop after a failed call where ranks share a GPU: every rank's device work drained first."""
import time

from triton_dist.launch import RankPool

from .conftest import cpu_only


@cpu_only
def test_drain_waits_for_a_busy_rank_and_skips_a_dead_one():
    with RankPool(2) as pool:
        pool._conns[1].send((time.sleep, (2,), {}))  # rank 1 still in a call when the drain is asked
        t0 = time.monotonic()
        assert pool._drain(60) == [0, 1]
        assert time.monotonic() - t0 >= 1.5  # it answered the sleep first, then the drain
        pool.run(time.sleep, 0)  # drained ranks serve calls as before
        pool._procs[1].kill()
        pool._procs[1].join(5)
        t0 = time.monotonic()
        assert pool._drain(60) == [0]
        assert time.monotonic() - t0 < 30


class _ResetConnection:
    """A rank's pipe whose process died mid-message: the read raises ConnectionResetError, not EOFError."""

    def send(self, _):
        raise BrokenPipeError

    def poll(self, _):
        return True

    def recv(self):
        raise ConnectionResetError(104, "Connection reset by peer")


@cpu_only
def test_a_reset_connection_counts_as_a_dead_rank():
    with RankPool(2) as pool:
        alive = pool._conns[1]
        pool._conns[1] = _ResetConnection()
        try:
            assert pool._drain(60) == [0]
        finally:
            pool._conns[1] = alive
