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
