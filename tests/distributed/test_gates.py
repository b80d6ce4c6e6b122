"""The distributed gate as a user runs it: a scratch project run by `pytest` (the precision_distributed marker
launching the ranks, also under `-n 2`) and by `torchrun --nproc_per_node 2 -m pytest`; one baseline file,
one verdict, a regression planted on one rank caught on all, dead ranks, another world size."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pytest_precision

HERE = Path(__file__).parent
TORCHRUN = Path(sys.executable).with_name("torchrun")

GATE = """
import os

import pytest
import torch
import torch.distributed as dist
from sharded_models import rowwise_lm, token_batch

from pytest_precision import Variant

WORLD = int(os.environ.get("GATE_WORLD", "2"))


def plant(model):
    # A kernel bug on one rank only: block 1 adds noise there.
    if os.environ.get("PLANT_RANK") == str(dist.get_rank()):
        generator = torch.Generator().manual_seed(0)
        model.blocks[1].register_forward_hook(
            lambda module, args, out: out + 0.05 * torch.randn(out.shape, generator=generator).to(out.dtype)
        )
    return model


@pytest.mark.precision_distributed(world_size=WORLD)
def test_gate(precision, assert_precision_within):
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = token_batch(rows=4)
    mine = ids[rank * 4 // world : (rank + 1) * 4 // world]
    if os.environ.get("DIE_RANK") == str(rank):
        os._exit(3)
    variant = Variant("bf16", dtype="bfloat16", prepare=plant)
    if os.environ.get("FP16_RANK") == str(rank):  # a rank-dependent test: the global numbers mix two variants
        variant = Variant("bf16", dtype="float16")
    backward = not os.environ.get("FORWARD_ONLY")
    report = precision.run(rowwise_lm(), {"input_ids": mine, "labels": mine}, [variant], backward=backward)
    assert_precision_within(report)
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    shutil.copy(HERE / "sharded_models.py", tmp_path / "sharded_models.py")
    (tmp_path / "test_gate.py").write_text(GATE)
    return tmp_path


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(project: Path, *arguments: str, torchrun: int = 0, **environment: str) -> tuple[int, str]:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *arguments]
    if torchrun:
        # A port of its own: torchrun's default (29500) may be held by another torchrun on the machine. (The 300 s
        # hangs this test once had on torch 2.6 were in destroy_process_group: see ranks.shut_down.)
        command = [os.fspath(TORCHRUN), "--nproc_per_node", str(torchrun), "--master_port", str(free_port())]
        command += ["-m", "pytest", "-p", "no:cacheprovider"]
        command += list(arguments)
    # The package under test (a mutation check runs a copy of the tree), ahead of any installed one.
    package_root = os.fspath(Path(pytest_precision.__file__).parent.parent)
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **environment, "PYTHONPATH": path}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def baseline_files(project: Path) -> list[Path]:
    return sorted((project / "baselines").rglob("*.json")) if (project / "baselines").exists() else []


def test_the_marker_runs_an_update_compare_cycle_with_one_file(project: Path) -> None:
    code, output = run(project, "--update-baselines")
    assert code == 0, output
    assert "precision baselines (update, baselines): 1 written" in output
    [written] = baseline_files(project)
    environment = json.loads(written.read_text())["environment"]
    assert (environment["world_size"], environment["mesh"]) == (2, None)
    code, output = run(project, "--precision-tables")
    assert code == 0, output
    assert "precision baselines (compare, baselines): 1 passed" in output
    assert "rms_rel against the fp32 reference" in output and "first (embed)" in output  # rank 0's tables
    code, output = run(project, "-n", "2")
    assert code == 0 and "1 passed" in output, output
    assert baseline_files(project) == [written]


def test_a_regression_planted_on_one_rank_fails_every_rank_naming_the_layer(project: Path) -> None:
    assert run(project, "--update-baselines")[0] == 0
    code, output = run(project, PLANT_RANK="1")
    assert code == 1, output
    # Rank 0 computed nothing wrong itself, and still fails, on the global numbers, naming the layer.
    assert "every rank (2 of 2) failed alike" in output, output
    assert "blocks.1" in output and "regressed" in output, output


def test_torchrun_runs_the_cycle_and_only_rank_0_writes_and_summarises(project: Path) -> None:
    code, output = run(project, "--update-baselines", torchrun=2)
    assert code == 0, output
    assert output.count("precision baselines (update") == 1, output
    assert len(baseline_files(project)) == 1
    code, output = run(project, torchrun=2)
    assert code == 0, output
    assert output.count("precision baselines (compare, baselines): 1 passed") == 1, output
    code, output = run(project, torchrun=2, PLANT_RANK="0")
    assert code != 0 and output.count("blocks.1") >= 2, output  # both ranks' failure reports name it


def test_a_baseline_from_2_ranks_compared_on_4_warns_and_still_gates(project: Path) -> None:
    # Forward only: each sequence's numbers do not depend on which rank holds it (the bf16 gradients do: each
    # rank rounds its own before they are averaged, which is why another world size is worth the warning).
    assert run(project, "--update-baselines", FORWARD_ONLY="1")[0] == 0
    code, output = run(project, GATE_WORLD="4", FORWARD_ONLY="1")
    assert code == 0, output
    assert "world_size: 2 in the baseline, 4 now" in output, output


def test_a_rank_that_dies_ends_the_test_with_a_clear_error(project: Path) -> None:
    assert run(project, "--update-baselines")[0] == 0
    started = time.monotonic()
    code, output = run(project, DIE_RANK="1", PYTEST_PRECISION_TIMEOUT="10")
    assert code == 1, output
    assert time.monotonic() - started < 90
    assert "rank 1" in output and "exited with status 3 without an outcome" in output, output


def test_a_bad_marker_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.precision_distributed(world_size=0)
        def test_one():
            pass
        """
    )
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*precision_distributed(world_size=N, timeout=seconds) takes a whole number*"])


def test_a_baseline_from_before_world_sizes_were_recorded_warns_under_several_ranks(project: Path) -> None:
    assert run(project, "--update-baselines", FORWARD_ONLY="1")[0] == 0
    [path] = baseline_files(project)
    document = json.loads(path.read_text())
    del document["environment"]["world_size"], document["environment"]["mesh"]  # as files written before
    path.write_text(json.dumps(document, indent=1))
    code, output = run(project, FORWARD_ONLY="1")
    assert code == 0, output
    assert "world_size: 1 in the baseline, 2 now" in output, output


def test_ranks_comparing_different_variants_fail_instead_of_gating_a_mixture(project: Path) -> None:
    assert run(project, "--update-baselines", FORWARD_ONLY="1")[0] == 0
    code, output = run(project, FORWARD_ONLY="1", FP16_RANK="1")
    assert code == 1, output
    assert "the ranks' reports differ (rank(s) 1 against rank 0)" in output, output
