"""Each row's end by budget and stop ids (`hf_dllm_spec.integration.rows`): the scan from a known-clean prefix
and the incremental scan of a row's growing host list give what a whole scan gives."""

import warnings

import torch
from conftest import tiny_family_models
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_dllm_spec.integration.rows import RowEnds, StopScan, row_end

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


class _FiresOn7(StoppingCriteria):
    """A criterion that fires on the token 7 and records what each call saw (`input_ids` as lists)."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(input_ids.tolist())
        return input_ids[:, -1] == 7


def test_a_criterion_that_fires_ends_the_row():
    """The tokens were cut where the criterion fired, but the row was not reported ended: it decoded on to its
    budget (forwards and committed tokens of 12 instead of 2)."""
    ends = RowEnds(10, [], StoppingCriteriaList([_FiresOn7()]), torch.zeros((1, 1), dtype=torch.long), 0)
    tokens, ended = ends.final_tokens(0, torch.tensor([1, 7, 3]))
    assert tokens.tolist() == [1, 7] and ended is True

    class AfterTwo(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 5, dtype=torch.bool)

    model = tiny_family_models()["sdar"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([[5, 17, 42]]), stopping_criteria=StoppingCriteriaList([AfterTwo()]),
                             decoding_strategy="ar", max_new_tokens=12, pad_token_id=0, eos_token_id=None,
                             return_dict_in_generate=True)
    assert out.sequences.shape[1] == 5
    assert out.spec_stats.num_committed_tokens == 2 and out.spec_stats.nfe == 3      # a prefill, two AR steps


def test_criteria_see_an_ended_row_continued_with_the_pad_id():
    """As stock `generate` shows them: after row 0's stop id, its later positions are `pad_token_id` (they were 0)."""
    criterion = _FiresOn7()
    ends = RowEnds(4, [2], StoppingCriteriaList([criterion]), torch.zeros((2, 1), dtype=torch.long), 99)
    ends.finish([torch.tensor([2, 5, 5, 5]), torch.tensor([1, 2, 3, 4])])
    assert criterion.seen[-1][0] == [0, 2, 99, 99, 99]


def test_finish_cuts_every_row_where_its_criterion_fires():
    ends = RowEnds(10, [], StoppingCriteriaList([_FiresOn7()]), torch.zeros((2, 1), dtype=torch.long), 0)
    out = ends.finish([torch.tensor([1, 7, 2, 3]), torch.tensor([1, 2, 3, 4])])
    assert [o.tolist() for o in out] == [[1, 7], [1, 2, 3, 4]]
