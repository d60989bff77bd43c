"""NIXL's CALL and ANSWER notifications (expertd.nixl, docs/dataplane.md): what is
packed is what is read back; a CALL carries its routes only when they are small
enough, and one whose length fits neither form is refused."""

from __future__ import annotations

import numpy as np
import pytest

from expertd import nixl


def test_a_call_reads_back_with_and_without_its_routes():
    m, k = 3, 8
    ids = np.arange(m * k, dtype=np.int64).reshape(m, k) - 1  # -1: a padded route
    w = np.linspace(0, 1, m * k, dtype=np.float32).reshape(m, k)
    trace = (1, 2, 3, 1)
    bare = nixl.pack_call(5, 9, 2, m, k, 1000, 77, trace)
    assert nixl.unpack_call(bare) == (5, 9, 2, m, k, 1000, 77, *trace)
    assert nixl.call_routes(bare, m, k) is None
    assert nixl.routes_inline(m, k)
    full = nixl.pack_call(5, 9, 2, m, k, 1000, 77, trace, nixl.inline_routes(ids, w))
    assert nixl.unpack_call(full) == (5, 9, 2, m, k, 1000, 77, *trace)
    got_ids, got_w = nixl.call_routes(full, m, k)
    assert got_ids.dtype == np.int32 and (got_ids == ids).all()
    assert got_w.dtype == np.float32 and (got_w == w).all()
    got_ids[0, 0] = 5  # a copy: the checks may keep it
    assert nixl.call_routes(full, m, k)[0][0, 0] == -1


def test_routes_inline_only_up_to_the_limit():
    k = 8
    most = nixl.ROUTES_INLINE // (8 * k)
    assert nixl.routes_inline(most, k) and not nixl.routes_inline(most + 1, k)
    assert not nixl.routes_inline(0, k)


@pytest.mark.parametrize("cut", [1, 8, 4 * 3 * 8])
def test_a_call_of_the_wrong_length_is_refused(cut):
    m, k = 3, 8
    full = nixl.pack_call(
        0, 1, 0, m, k, 10, 0, routes=nixl.inline_routes(np.zeros((m, k)), np.zeros((m, k)))
    )
    with pytest.raises(ValueError):
        nixl.call_routes(full[:-cut], m, k)
    with pytest.raises(ValueError):
        nixl.call_routes(full, m + 1, k)  # routes for another m
    with pytest.raises(ValueError):
        nixl.unpack_call(full[: 1 + cut % 60])  # shorter than its fields


def test_an_answer_reads_back():
    timing = {"queue_us": 1, "compute_us": 2, "total_us": 3, "stage_us": 4, "device_us": 5}
    timing |= {"batch_requests": 6, "batch_tokens": 7}
    msg = nixl.pack_answer(2, 3, 0, 4, timing)
    assert nixl.unpack_answer(msg) == (2, 3, 0, 4, timing, "")
    err = nixl.pack_answer(2, 3, 3, 0, {}, "layer 9 outside [0, 1)")
    slot, seq, status, rows, _timing, text = nixl.unpack_answer(err)
    assert (slot, seq, status, rows, text) == (2, 3, 3, 0, "layer 9 outside [0, 1)")
