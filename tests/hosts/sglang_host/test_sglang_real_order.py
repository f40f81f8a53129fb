"""The linker in SGLang's real order: batches of several requests admitted by
SGLang's own ``PrefillAdder``, different hits in one batch, an abort while
queued and one while loading, a chunked request, a flush between batches.

What still imitates SGLang here (``layerlift.testing.sglang_harness``): the
request row is allocated before ``init_next_round_input`` (SGLang's
``prepare_for_extend`` allocates it after admission), the forward is a
stand-in that reads each layer through the pools' accessors, and the tree
insert after the forward is the harness's (``cache_finished_req`` needs a
model runner).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sglang_testkit import PAGE, exact_or_zero, tokens

from layerlift.testing.sglang_harness import SGLangHost

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]

Make = Callable[..., SGLangHost]

# The restoring cache's loads go through staging (the default for these
# small units) or straight into its slots (``load_in_place.py``).
MODES = {"staged": {}, "in place": {"in_place_load_min_kib": 0}}


@pytest.mark.parametrize("mode", list(MODES))
def test_one_batch_of_several_requests_with_different_hits_and_aborts(make_host: Make, mode: str) -> None:
    a, b = make_host(), make_host(segment_mib=0, **MODES[mode])
    long, short, queued_abort, loading_abort = (tokens(6, seed=100), tokens(2, seed=101),
                                                 tokens(3, seed=102), tokens(4, seed=103))
    a.compute(long, [3 * PAGE, 6 * PAGE])
    a.compute(short, [2 * PAGE])
    a.compute(queued_abort, [3 * PAGE])
    a.compute(loading_abort, [4 * PAGE])
    a.settle_offloads()
    miss = tokens(3, seed=104)
    adms = b.admit_batch([[*p, 1] for p in (long, short, miss, queued_abort, loading_abort)])
    assert [x.restore.loaded_tokens for x in adms] == [6 * PAGE, 2 * PAGE, 0, 3 * PAGE, 4 * PAGE]
    assert all(x.admitted for x in adms)
    b.abort(adms[3])  # aborted while its load is queued: cancelled, its staging back
    assert adms[3].done
    b.start_loads()
    b.abort(adms[4])  # aborted while loading: finished with the batch, then freed
    assert not adms[4].done
    for x in adms:
        b.forward(x)
    assert b.finish(adms) == []
    assert b.linker.finished[-1].in_place == (mode == "in place")
    for x, toks in ((adms[0], long), (adms[1], short)):
        assert x.restore.ok
        assert all(exact_or_zero(b, x.restore, toks).values())
    assert not adms[4].restore.ok and adms[4].done
    assert b.linker.ring.idle()
    # The next round: the restored prompts hit b's device; the aborted ones load again.
    again = b.admit_batch([[*long, 2], [*queued_abort, 2]])
    assert [x.restore.hit_tokens for x in again] == [0, 3 * PAGE]
    b.start_loads()
    for x in again:
        b.forward(x)
    assert b.finish(again) == []
    assert all(exact_or_zero(b, again[1].restore, queued_abort).values())


@pytest.mark.parametrize("mode", list(MODES))
def test_the_prefill_adder_chunks_a_restored_request(make_host: Make, mode: str) -> None:
    """A chunk budget smaller than the request: SGLang's adder still takes the
    whole load-back (it commits all promised FULL tokens or none) and chunks
    the extend; the load lands exact."""
    a, b = make_host(), make_host(segment_mib=0, **MODES[mode])
    toks = tokens(4, seed=110)
    a.compute(toks, [4 * PAGE])
    a.settle_offloads()
    prompt = [*toks, *tokens(3, seed=111)]  # 4 pages restorable, 3 more to compute
    (adm,) = b.admit_batch([prompt], rem_chunk_tokens=2 * PAGE)
    assert adm.admitted and adm.chunked
    assert adm.restore.loaded_tokens == 4 * PAGE
    b.start_loads()
    b.forward(adm)
    assert b.finish([adm]) == []
    assert b.linker.finished[-1].in_place == (mode == "in place")
    assert all(exact_or_zero(b, adm.restore, toks).values())


@pytest.mark.parametrize("mode", list(MODES))
def test_a_flush_between_batches_then_the_next_batch_loads_exact(make_host: Make, mode: str) -> None:
    a, b = make_host(), make_host(segment_mib=0, **MODES[mode])
    first, second = tokens(3, seed=120), tokens(5, seed=121)
    a.compute(first, [3 * PAGE])
    a.compute(second, [5 * PAGE])
    a.settle_offloads()
    (x,) = b.admit_batch([[*first, 1]])
    b.start_loads()
    b.forward(x)
    assert b.finish([x]) == []
    b.flush_cache()  # SGLang's flush_cache: reset, then the allocators' clears
    assert b.linker.ring.idle() and b.linker._offloader.pending() == 0
    adms = b.admit_batch([[*first, 2], [*second, 2]])
    assert [y.restore.loaded_tokens for y in adms] == [3 * PAGE, 5 * PAGE]  # the tree is empty
    b.start_loads()
    for y in adms:
        b.forward(y)
    assert b.finish(adms) == []
    assert b.linker.finished[-1].in_place == (mode == "in place")
    for y, toks in zip(adms, (first, second), strict=True):
        assert all(exact_or_zero(b, y.restore, toks).values())
