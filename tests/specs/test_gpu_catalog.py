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


@pytest.mark.parametrize(
    ("typed", "name"),
    [
        ("RTX4090", "RTX-4090"),
        ("rtx 4090", "RTX-4090"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("rtx_5090", "RTX-5090"),
        ("RTX 6000 Ada", "RTX-6000-Ada"),
        ("l40", "L40"),
        ("h20", "H20"),
        ("AMD Instinct MI325X", "MI325X"),
        ("b100", "B100"),
    ],
)
def test_names_users_type(typed: str, name: str) -> None:
    assert get_gpu(typed).name == name


def test_any_capacity_in_gb_or_gib() -> None:
    # GB is 10^9 bytes, GiB 2^30 (IEC 80000-13); the figure is the usable capacity.
    assert get_gpu("32GB").memory_bytes == 32_000_000_000
    assert get_gpu("24GiB").memory_bytes == 24 * 1024**3
    assert get_gpu("23.65 GiB").memory_bytes == round(23.65 * 1024**3)
    for bad in ("0GB", "5000GiB"):
        with pytest.raises(SpecError, match="gpu: capacity"):
            get_gpu(bad)


def test_new_cards_carry_their_source() -> None:
    # RTX 5090: "GPU 0 has a total capacity of 31.37 GiB" (Wan-Video/Wan2.1 issue 465)
    assert get_gpu("RTX-5090").memory_bytes == round(31.37 * 1024**3)
    # H20: "has a total capacity of 95.00 GiB" (modelscope/DiffSynth-Studio issue 1238)
    assert get_gpu("H20").memory_bytes == 95 * 1024**3
    for name in ("RTX-5090", "RTX-6000-Ada", "L40", "H20", "GH200", "B100", "MI325X"):
        assert get_gpu(name).datasheet.startswith("https://")


def test_an_unknown_gpu_says_a_capacity_works() -> None:
    with pytest.raises(SpecError, match="--gpu 32GB"):
        get_gpu("my-lab-card")
