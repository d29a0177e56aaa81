"""GPU lookup: ambiguous names are refused with the choices; fp8 needs float8 tensor cores."""

from __future__ import annotations

import pytest

from trainmem import TrainingConfig, estimate
from trainmem.errors import SpecError
from trainmem.specs.hardware import check_precision_on_gpu, get_gpu, supports_fp8


@pytest.mark.parametrize(
    ("name", "choices"),
    [
        ("A100", "A100-80GB, A100-40GB"),  # was silently A100-80GB
        ("h100", "H100-80GB, H100-94GB"),
        ("V100", "V100-16GB, V100-32GB"),
    ],
)
def test_ambiguous_names_list_the_matches(name: str, choices: str) -> None:
    with pytest.raises(SpecError, match=f"ambiguous: it could be {choices}; name one"):
        get_gpu(name)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("a100-40gb", "A100-40GB"), ("A10", "A10"), ("4090", "RTX-4090"), ("mi300", "MI300X")],
)
def test_names_that_name_one_gpu(name: str, expected: str) -> None:
    assert get_gpu(name).name == expected


@pytest.mark.parametrize("value", [None, 80, "", "   "])
def test_gpu_of_the_wrong_type(value: object) -> None:
    with pytest.raises(SpecError, match="gpu: must be a GPU name"):  # get_gpu(None): TypeError
        get_gpu(value)  # type: ignore[arg-type]


def test_fp8_support_follows_compute_capability() -> None:
    # float8 tensor cores: sm_89 (Ada: L4, L40S, RTX 4090), sm_90 (Hopper), sm_100 (Blackwell),
    # AMD CDNA3 (MI300X); not Volta, Turing, Ampere or CDNA2
    having = {name for name in ("L4", "L40S", "RTX-4090", "H100-80GB", "B200", "MI300X")}
    lacking = {"V100-16GB", "T4", "A100-80GB", "A10G", "RTX-3090", "MI250"}
    assert all(supports_fp8(get_gpu(n)) for n in having)
    assert not any(supports_fp8(get_gpu(n)) for n in lacking)


def test_fp8_on_a_v100_is_refused() -> None:
    with pytest.raises(SpecError, match="precision: fp8-mixed needs float8 tensor cores"):
        check_precision_on_gpu("fp8-mixed", get_gpu("V100-16GB"))
    with pytest.raises(SpecError, match="fp8-mixed"):  # was 'fits'
        estimate("gpt2", TrainingConfig(precision="fp8-mixed"), gpu="V100-16GB")
    check_precision_on_gpu("fp8-mixed", get_gpu("H100-80GB"))
