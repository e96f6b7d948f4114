"""Each row's end by budget and stop ids (`hf_dllm_spec.integration.stopping`): the scan from a known-clean prefix
and the incremental scan of a row's growing host list give what a whole scan gives."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dllm_spec.integration.stopping import StopScan, row_end

ids_lists = st.lists(st.integers(0, 5), max_size=12)


def whole_scan(ids: list[int], budget: int, stops: set[int]) -> tuple[int, bool]:
    """The definition: cut after the first stop id within the budget (kept), else at the budget or the end."""
    kept = ids[:budget]
    cut = next((k + 1 for k, token in enumerate(kept) if token in stops), len(kept))
    return cut, cut < len(ids) or cut >= budget or (cut > 0 and ids[cut - 1] in stops)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(ids=ids_lists, budget=st.integers(0, 14), stops=st.sets(st.integers(0, 5), max_size=2), data=st.data())
def test_row_end_from_a_clean_prefix_is_the_whole_scan(ids, budget, stops, data):
    clean = next((k for k, token in enumerate(ids) if token in stops), len(ids))   # ids[:clean] hold no stop id
    start = data.draw(st.integers(0, clean), label="start")
    assert row_end(ids, budget, stops) == whole_scan(ids, budget, stops)
    assert row_end(ids, budget, stops, start) == whole_scan(ids, budget, stops)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(blocks=st.lists(ids_lists, min_size=1, max_size=8), budget=st.integers(1, 40),
       stops=st.sets(st.integers(0, 5), max_size=2))
def test_stop_scan_of_a_growing_row_is_the_whole_scan(blocks, budget, stops):
    """A row's host list extended block by block (as the decoding loop does) until it ends: every check equals
    the whole scan of the list so far."""
    scan, row = StopScan(), []
    for block in blocks:
        row.extend(block)
        got = scan.row_end(0, row, budget, stops)
        assert got == whole_scan(row, budget, stops)
        if got[1]:
            break


def test_stop_scan_reads_only_what_was_appended_to_the_same_list():
    """The scan is incremental: ids already checked are not read again for the same list object (the contract:
    a row's final tokens only grow), while another list for the row is scanned whole; an ended row starts over."""
    scan, stops = StopScan(), {2}
    row = [5, 5, 5]
    assert scan.row_end(7, row, 100, stops) == (3, False)
    row[0] = 2                                           # breaks the contract on purpose: a checked id changes
    row.append(5)
    assert scan.row_end(7, row, 100, stops) == (4, False)        # only the appended id was read
    assert scan.row_end(7, list(row), 100, stops) == (1, True)   # a new list object: scanned whole, ends
    assert scan.row_end(7, row, 100, stops) == (1, True)         # the ended row was forgotten: scanned whole
