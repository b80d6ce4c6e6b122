"""check_fsdp_device: FSDP2 on the CPU is refused, naming the version, on a torch that cannot run it. Both sides
are tested on any torch by giving the check the version to judge."""

from __future__ import annotations

import pytest
from torch import nn

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.distributed import sharding


@pytest.mark.parametrize(
    ("version", "device", "refused"),
    [
        ((2, 6), "cpu", True),
        ((2, 7), "cpu", False),
        ((2, 15), "cpu", False),
        ((2, 6), "cuda", False),
    ],
)
def test_fsdp2_on_the_cpu_needs_torch_2_7(
    monkeypatch: pytest.MonkeyPatch, version: tuple[int, int], device: str, refused: bool
) -> None:
    monkeypatch.setattr(sharding, "torch_version", lambda: version)
    if refused:
        with pytest.raises(ConfigurationError, match=r"FSDP2 \(fully_shard\) runs on the CPU from torch 2\.7"):
            sharding.check_fsdp_device([nn.Linear(2, 2)], device)
    else:
        sharding.check_fsdp_device([nn.Linear(2, 2)], device)


def test_an_unsharded_model_is_never_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharding, "torch_version", lambda: (2, 6))
    sharding.check_fsdp_device([], "cpu")
