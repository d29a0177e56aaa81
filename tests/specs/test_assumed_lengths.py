"""The step lengths an estimate assumes are said (``details["assumed"]["lengths"]``): one
fixed shape at ``seq_len`` unless ``earlier_seq_lens`` lists the steps before it (Note [Steps of
varying length]); session 25's ms-swift probe measured every cell of a run over batches padded
to their own longest sample above the fixed-length figure."""

from __future__ import annotations

from trainmem.specs.assumptions import assumptions, assumptions_line, versions_text


def test_a_language_model_says_every_step_is_at_seq_len() -> None:
    assumed = assumptions({"framework": "hf-trainer", "seq_len": 2048})
    # no number: plan's candidates (a sequence-length search among them) share one text
    assert assumed["lengths"].startswith("every micro-batch at the sequence length")
    assert assumed == assumptions({"framework": "hf-trainer", "seq_len": 8})
    assert "--earlier-seq-lens" in assumed["lengths"]
    assert "lengths: every micro-batch at the sequence length" in assumptions_line(assumed)
    # said once, after the versions, not among them
    assert "every micro-batch" not in versions_text(assumed)
    assert assumptions_line(assumed).count("every micro-batch") == 1


def test_earlier_steps_given_or_an_image_model_say_nothing_of_lengths() -> None:
    given = assumptions({"seq_len": 2048, "earlier_seq_lens": (512, 1024)})
    assert "lengths" not in given
    assert "lengths:" not in assumptions_line(given)
    for library in ("diffusers", "timm"):
        assert "lengths" not in assumptions({"seq_len": 2048}, library)
