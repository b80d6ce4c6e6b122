"""global_exact_sums across 2 gloo ranks (spawned processes, CPU): the metrics of a tensor split over ranks
equal one process's metrics of the whole tensor, on every rank."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

from pytest_precision.distributed import global_exact_sums
from pytest_precision.metrics import EXACT_SUMS, exact_error, exact_sums

WORLD = 2


def cases() -> dict[str, tuple[torch.Tensor, torch.Tensor, list[slice]]]:
    """name -> (reference, variant, the rows each rank holds)."""
    generator = torch.Generator().manual_seed(11)
    reference = torch.randn(4, 16, 32, generator=generator) + 0.5
    bf16_like = reference.to(torch.bfloat16).to(torch.float32)
    poisoned = bf16_like.clone()
    poisoned[3, 2, 5] = float("nan")
    poisoned[3, 7, 1] = float("inf")
    poisoned_both = poisoned.clone()
    poisoned_both[0, 0, 0] = float("-inf")
    constant = torch.full((4, 8), 0.1)
    return {
        "data-parallel halves": (reference, bf16_like, [slice(0, 2), slice(2, 4)]),
        "NaN and Inf on rank 1 only": (reference, poisoned, [slice(0, 2), slice(2, 4)]),
        "non-finite values on both ranks": (reference, poisoned_both, [slice(0, 2), slice(2, 4)]),
        "uneven, rank 1 empty": (reference, bf16_like, [slice(0, 4), slice(4, 4)]),
        "uneven, 1 and 3 rows": (reference, bf16_like, [slice(0, 1), slice(1, 4)]),
        "constant reference": (constant, constant + 1e-3 * torch.arange(8.0), [slice(0, 3), slice(3, 4)]),
    }


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        named = cases()
        parts = [exact_sums(reference[rows[rank]], variant[rows[rank]]) for reference, variant, rows in named.values()]
        whole = global_exact_sums(parts)
        result = {name: vector.tolist() for name, vector in zip(named, whole, strict=True)}
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[float]]]:
    folder = tmp_path_factory.mktemp("gloo")
    context = multiprocessing.get_context("spawn")
    outputs = [folder / f"rank{rank}.json" for rank in range(WORLD)]
    processes = [
        context.Process(target=_rank, args=(rank, str(folder / "store"), str(outputs[rank]))) for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    for process in processes:
        if process.is_alive():
            process.kill()
            pytest.fail("a gloo rank did not finish within 120 s")
    assert [p.exitcode for p in processes] == [0] * WORLD, "a gloo rank failed (its traceback is above)"
    return [json.loads(path.read_text()) for path in outputs]


@pytest.mark.parametrize("name", list(cases()))
def test_every_rank_gets_the_whole_tensors_sums(per_rank, name):
    reference, variant, _ = cases()[name]
    expected = exact_sums(reference, variant).tolist()
    for rank, result in enumerate(per_rank):
        got = result[name]
        assert got[0] == expected[0] and got[7] == expected[7], f"rank {rank}: counts {got} vs {expected}"
        assert got[6::] == pytest.approx(expected[6::], rel=0, abs=0), f"rank {rank}: extremes differ"
        assert got[1:6] == pytest.approx(expected[1:6], rel=1e-12, abs=1e-12), f"rank {rank}: sums differ"
    assert per_rank[0][name] == per_rank[1][name], "the ranks disagree"


@pytest.mark.parametrize("name", list(cases()))
def test_metrics_from_the_reduced_sums_equal_one_process(per_rank, name):
    reference, variant, _ = cases()[name]
    whole = exact_error(exact_sums(reference, variant).tolist())
    split = exact_error(per_rank[0][name])
    for field, want in vars(whole).items():
        got = getattr(split, field)
        if want is None or isinstance(want, int):
            assert got == want, field
        else:
            assert got == pytest.approx(want, rel=1e-9, abs=1e-15), field


def test_a_vector_that_is_not_an_exact_sums_vector_is_refused():
    expected = rf"vector 1 is \(7,\) torch.float64, expected an exact_sums vector \({EXACT_SUMS}"
    with pytest.raises(ValueError, match=expected):
        global_exact_sums([torch.zeros(EXACT_SUMS, dtype=torch.float64), torch.zeros(7, dtype=torch.float64)])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
