"""What a user meets on the web page that the CLI says too (helper useraudit, session 24)."""

from __future__ import annotations

import re

from trainmem.web import handlers as h
from trainmem.web.form import default_values


def test_plan_rows_state_the_seq_len_granularity() -> None:
    # `trainmem plan`'s "fixed:" line says "(multiples of 8 tokens)"; the page's seq_len row
    # must say it too, and the micro-batch row (searched one by one) must not
    raw = h.widget_values({**default_values(), "model": "gpt2", "gpu": "T4"})
    _, plan = h.fit_and_plan(h.FIT_TAB, None, *raw)
    rows = dict(re.findall(r'<tr data-dimension="(\w+)">(.*?)</tr>', plan))
    assert "(multiples of 8 tokens)" in rows["seq_len"]
    assert "multiples of" not in rows["micro_batch_size"]


def test_a_plan_where_nothing_fits_gives_no_granularity() -> None:
    # llama-3.1-8b's weights alone exceed a T4: "nothing fits", not "nothing fits (multiples
    # of 8 tokens)"
    raw = h.widget_values({**default_values(), "model": "llama-3.1-8b", "gpu": "T4"})
    _, plan = h.fit_and_plan(h.FIT_TAB, None, *raw)
    rows = dict(re.findall(r'<tr data-dimension="(\w+)">(.*?)</tr>', plan))
    assert "<td>nothing fits</td>" in rows["seq_len"] and "multiples of" not in rows["seq_len"]


def test_an_oom_verdict_puts_the_capacity_beside_the_figure_it_qualifies() -> None:
    # gpt2 at 9 x 1024 on a T4 (the CLI: 13.99 GiB allocated + 0.49 GiB context < 14.75 GiB,
    # out of memory by fragmentation) read "... so there is no reserved figure of 14.75 GiB
    # usable"
    out = _update(model="gpt2", gpu="T4", micro_batch_size=9, seq_len=1024)
    text = re.sub(r"<[^>]+>", "", out["result"])
    assert "peak allocated + CUDA context 14.47 GiB of 14.75 GiB usable; the caching " in text
    assert "(fragmentation: no free block large enough), so there is no reserved figure." in text
    assert "reserved figure of" not in text


def _update(**changes: object) -> dict[str, str]:
    raw = h.widget_values({**default_values(), **changes})
    return dict(zip(h.ESTIMATE_OUTPUTS, h.update([], None, *raw), strict=True))
