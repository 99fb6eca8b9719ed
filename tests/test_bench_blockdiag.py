"""The block-diag and grouped benchmark workloads (spchain/bench/blockdiag.py, grouped.py) at quick sizes."""

import pytest

pytest.importorskip("torch")

from spchain import bench  # noqa: E402
from spchain.bench import core, grouped  # noqa: E402


@pytest.mark.parametrize("workload", ["block-diag", "grouped"])
def test_every_method_of_every_case_matches_the_float64_reference(workload):
    module = bench.workload(workload)
    for name in module.CASES:
        case = bench.make_case(workload, name, quick=True)
        assert list(case.methods)[0] == "spchain" and set(case.methods) <= set(module.METHODS)
        reference = case.reference()
        for method, run in case.methods.items():
            assert core.max_rel_error(run(), reference) < 1e-5, (name, method)


@pytest.mark.parametrize("workload", ["block-diag", "grouped"])
def test_unknown_case_is_a_value_error(workload):
    with pytest.raises(ValueError, match="has no case 'nope'"):
        bench.make_case(workload, "nope", quick=True)


def test_group_sizes_are_uneven_and_sum_to_the_rows():
    sizes = grouped.group_sizes(16384, 16)
    assert len(sizes) == 16 and sum(sizes) == 16384 and max(sizes) > 2 * min(sizes)
