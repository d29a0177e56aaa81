"""The published rules of thumb reproduce their authors' own numbers."""

from __future__ import annotations

from trainmem.analytic.formulas import gpt2_calculator, model_memory_rule, zero_paper


def test_gpt2_calculator_reproduces_the_blog_post() -> None:
    # shared/seeds "Transformer Memory Requirements": GPT-2 small, fp32, batch 8, seq 1024.
    r = gpt2_calculator(
        vocab=50257, e=768, num_layers=12, num_heads=12, b=8, t=1024, bytes_per_value=4
    )
    assert r["model_params"] == 123_568_896
    assert r["act_params"] == 3_088_334_848
    # the post prints 26.6 for 26.68e9 bytes: it truncates to one decimal
    assert int(r["total_bytes"] / 1e8) / 10 == 26.6


def test_zero_paper_gpt2_1_5b() -> None:
    # Rajbhandari et al. 2020: 1.5B parameters -> 24 GB model states; batch 32, seq 1K,
    # h=1600, 48 layers -> 12 * 1600 * 32 * 1024 * 48 values * 2 bytes = 60.4 GB activations.
    r = zero_paper(n=1_500_000_000, h=1600, b=32, s=1024, num_layers=48)
    assert r["model_states_bytes"] == 24_000_000_000
    assert round(r["activations_bytes"] / 1e9) == 60


def test_model_memory_rule_by_hand() -> None:
    # N = 1e9, P = 2: weights 2 GB, Adam 4 GB, grads 2 GB, intermediates 2 GB;
    # A = 4.6894e-4 * 1e9 + 1.8494e6 = 2,318,340 values per token; B=1, L=1000 -> 4.63668 GB.
    r = model_memory_rule(n=10**9, b=1, s=1000, bytes_per_value=2)
    assert r["activations_bytes"] == 4_636_680_000
    assert r["total_bytes"] == 10 * 10**9 + 4_636_680_000
