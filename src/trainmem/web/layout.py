"""The page (gradio Blocks): inputs on the left, results on the right, and the wiring of the
events to :mod:`trainmem.web.handlers`.

Every option widget is made from :func:`trainmem.web.form.field`, so the page offers exactly
the training settings of ``trainmem estimate``. Changing a widget runs the estimate (verdict,
breakdown, CLI command, URL) and then the slower details (timeline plot, per-module tables,
``fit`` and ``plan``).
"""

from __future__ import annotations

from typing import Any

try:
    import gradio as gr
except ImportError as exc:  # pragma: no cover - the web extra is missing
    raise ImportError("the web calculator needs gradio: pip install 'trainmem[web]'") from exc

from trainmem.report.plots import CATEGORY_COLORS
from trainmem.specs.hf import list_presets
from trainmem.specs.training import FSDP_HELP
from trainmem.web import handlers as h
from trainmem.web import views
from trainmem.web.form import (
    DEFAULT_ENGINE,
    DEFAULT_GPU,
    DEFAULT_MODEL,
    FLAG_DEFAULT,
    FSDP_CHOICES,
    GROUPS,
    MODEL_DEFAULT,
    NO_FSDP,
    default_values,
    engine_choices,
    field,
    gpu_choices,
)

CSS = """
.tm-slot:has(.prose:empty) {display: none}
.tm-grid {display: grid; grid-template-columns: max-content minmax(200px, 1fr); gap: 4px 24px}
@media (max-width: 1000px) {.tm-grid {grid-template-columns: 1fr}}
.verdict {padding: 12px 16px; border-radius: 8px; border: 1px solid #ccc; margin-bottom: 8px}
.verdict .head {font-size: 1.4em; font-weight: 700; margin-bottom: 4px}
.verdict.fits {background: #e6f4ea; border-color: #34a853}
.verdict.nofit {background: #fce8e6; border-color: #d93025}
.tm-legend {display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 0.9em; margin: 4px 0}
.tm-key {display: inline-flex; align-items: center; gap: 5px}
.tm-swatch {display: inline-block; width: 14px; height: 4px; border-radius: 2px}
.verdict.tight {background: #fef7e0; border-color: #f9ab00}
.tm-error {padding: 8px 12px; border-radius: 6px; background: #fce8e6; color: #a50e0e;
  border: 1px solid #d93025; font-weight: 600}
.tm-info {padding: 6px 12px; border-radius: 6px; background: #e8f0fe; border: 1px solid #4285f4}
table.tm {border-collapse: collapse; margin: 6px 0; font-size: 0.95em}
table.tm th, table.tm td {border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: left}
table.tm td.num {text-align: right; font-variant-numeric: tabular-nums}
table.tm td[title] {cursor: help}
table.tm tr.sum td {font-weight: 600}
table.tm caption {caption-side: bottom; font-size: 0.85em; color: #666; text-align: left}
#result[aria-busy="true"]:not(:has(#estimating))::before, #estimating::before {
  content: "Estimating... (a traced model takes a while)"; display: block; padding: 6px 12px;
  border-radius: 6px; background: #e8f0fe; border: 1px solid #4285f4; margin-bottom: 8px}
#result[aria-busy="true"] .verdict {opacity: 0.5}
"""

SLOT = ["tm-slot"]
"""CSS class of the HTML outputs that take no room while empty."""

SET_URL_JS = """(query) => {
  const url = new URL(window.location.href);
  url.search = query;
  window.history.replaceState(null, "", url.toString());
}"""
"""Write the page state into the address bar, so the link reproduces the configuration."""

BUSY_JS = """() => {
  document.getElementById("result")?.setAttribute("aria-busy", "true");
}"""
"""Mark the result as being computed (``aria-busy``; the CSS shows "Estimating..." above it
and dims the previous verdict) before the estimate's request: a traced model takes tens of
seconds, a minute on a loaded machine, and the estimate's own progress is hidden (it would
flash on every change of a formula family's fast estimate)."""

DONE_JS = """() => {
  document.getElementById("result")?.removeAttribute("aria-busy");
}"""
"""The estimate's outputs are drawn (a verdict or the message): the page's own completion
signal, which the browser tests wait on."""

FIRST_ESTIMATE = '<div id="estimating" aria-busy="true"></div>'
"""The result before the page's first estimate is drawn (the page loading, its query read):
busy, as :data:`BUSY_JS` marks every later one."""

_OPEN_GROUPS = ("Batch and sequence", "Precision and optimizer")


def _widget(name: str) -> Any:
    """The input widget of one TrainingConfig field, labelled with its CLI option and its
    ``--help`` text under it (:attr:`trainmem.web.form.Field.help`)."""
    f = field(name)
    label, info, elem_id = f.label, f.help, "opt-" + name.replace("_", "-")
    default = default_values()[name]
    if f.kind == "multi":
        return gr.CheckboxGroup(
            list(f.choices), value=list(default or ()), label=label, info=info, elem_id=elem_id
        )
    if f.kind == "choice":
        value = MODEL_DEFAULT if default is None else default
        return gr.Dropdown(list(f.choices), value=value, label=label, info=info, elem_id=elem_id)
    if f.kind == "tristate":  # true / false / the framework's and the release's
        value = FLAG_DEFAULT if default is None else ("true" if default else "false")
        return gr.Dropdown(list(f.choices), value=value, label=label, info=info, elem_id=elem_id)
    if f.kind == "bool":
        return gr.Checkbox(value=default, label=label, info=info, elem_id=elem_id)
    if f.kind == "str":  # a version, a resolution, a bucket size or "auto": typed as text
        value = "" if default is None else str(default)
        return gr.Textbox(value=value, label=label, info=info, elem_id=elem_id)
    if name == "seq_len":
        label += " (empty: the model's context, at most 4096)"
        default = None
    return gr.Number(
        value=default,
        precision=0 if f.kind == "int" else None,
        label=label,
        info=info,
        elem_id=elem_id,
    )


def build_app() -> Any:
    """The web calculator as a ``gradio.Blocks`` (not launched; see :func:`trainmem.web.launch`).

    Raises:
        ImportError: gradio is not installed (``pip install 'trainmem[web]'``).
    """
    w: dict[str, Any] = {}
    with gr.Blocks(
        title="trainmem: GPU memory of a training step", analytics_enabled=False
    ) as demo:
        gr.Markdown(
            "## trainmem: will this training run fit my GPU?\n"
            "Peak GPU memory of one training step, per category, from the analytic formulas "
            "(or, for a family they do not cover, the generic path: the real model traced on "
            "fake tensors; no GPU, no download). Every option is a `trainmem estimate` option; "
            "the link in the address bar reproduces this page."
        )
        notice = gr.HTML(elem_id="notice", elem_classes=SLOT)
        message = gr.HTML(elem_id="message", elem_classes=SLOT)
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                w["model"] = gr.Dropdown(
                    list_presets(),
                    value=DEFAULT_MODEL,
                    label="Model preset (type to search), hub id org/name, or timm:<name>",
                    filterable=True,
                    allow_custom_value=True,
                    elem_id="model",
                )
                config_file = gr.File(
                    label="... or upload a config.json (replaces the preset)",
                    file_types=[".json"],
                    type="filepath",
                    elem_id="config-file",
                    height=110,
                )
                w["gpu"] = gr.Dropdown(
                    gpu_choices(),
                    value=DEFAULT_GPU,
                    label="GPU (or a capacity: 32GB, 24GiB)",
                    allow_custom_value=True,
                    elem_id="gpu",
                )
                w["engine"] = gr.Dropdown(
                    engine_choices(),
                    value=DEFAULT_ENGINE,
                    label="Engine (--engine)",
                    elem_id="engine",
                )
                for group, names in GROUPS.items():
                    with gr.Accordion(group, open=group in _OPEN_GROUPS):
                        for name in names:
                            w[name] = _widget(name)
                            if name == "zero_stage":  # the CLI's --fsdp, beside it
                                w["fsdp"] = gr.Dropdown(
                                    list(FSDP_CHOICES),
                                    value=NO_FSDP,
                                    label="--fsdp",
                                    info=FSDP_HELP,
                                    elem_id="opt-fsdp",
                                )
                        if group == "Framework":
                            w["alloc_conf"] = gr.Textbox(
                                label="--alloc-conf (PYTORCH_CUDA_ALLOC_CONF)",
                                elem_id="opt-alloc-conf",
                            )
                            ds_file = gr.File(
                                label="Read settings from a ds_config.json",
                                file_types=[".json"],
                                type="filepath",
                                elem_id="ds-file",
                                height=110,
                            )
                            acc_file = gr.File(
                                label="Read settings from an accelerate config (.yaml)",
                                file_types=[".yaml", ".yml", ".json"],
                                type="filepath",
                                elem_id="accelerate-file",
                                height=110,
                            )
                            trainer_file = gr.File(
                                label="Read settings from an axolotl config, a torchtune recipe "
                                "(.yaml) or TrainingArguments / SFTConfig (.json)",
                                file_types=[".yaml", ".yml", ".json"],
                                type="filepath",
                                elem_id="trainer-file",
                                height=110,
                            )
            with gr.Column(scale=2):
                result = gr.HTML(FIRST_ESTIMATE, elem_id="result", elem_classes=SLOT)
                cli = gr.Textbox(
                    label="CLI: the same estimate in a terminal",
                    interactive=False,
                    buttons=["copy"],
                    elem_id="cli",
                )
                with gr.Tabs():
                    with gr.Tab("Timeline") as first_tab:
                        interactive = gr.LinePlot(
                            x="event",
                            y="GiB",
                            color="memory",
                            color_map={**CATEGORY_COLORS, "total": "#000000"},
                            tooltip=["memory", "GiB", "bytes", "phase", "at"],
                            x_title="allocation events of one steady-state step",
                            y_title="live memory, GiB (2^30 bytes)",
                            label="Memory over one training step (hover for bytes)",
                            height=360,
                            elem_id="timeline-interactive",
                        )
                        gr.HTML(views.legend_html())
                    with gr.Tab("Timeline picture") as picture_tab:
                        plot = gr.Image(
                            type="filepath",
                            label="Memory over one training step",
                            elem_id="timeline",
                            buttons=["download", "fullscreen"],
                        )
                    with gr.Tab("Per module") as modules_tab:
                        modules = gr.HTML(elem_id="modules-box")
                    with gr.Tab("Fit and plan") as fit_tab:
                        gr.Markdown(
                            "What to change so that it fits (`trainmem fit`), and the largest "
                            "micro-batch size and sequence length that fit (`trainmem plan`)."
                        )
                        fixes = gr.HTML(elem_id="fixes-box")
                        plan = gr.HTML(elem_id="plan-box")
                    with gr.Tab("Compare") as compare_tab:
                        with gr.Row():
                            pin_button = gr.Button("Pin this configuration", elem_id="pin")
                            clear_button = gr.Button("Clear", elem_id="clear-pins")
                        comparison = gr.HTML(h.compare([]), elem_id="compare-box")
                    with gr.Tab("Downloads") as downloads_tab:
                        download_button = gr.Button(
                            "Make JSON, HTML report and memory snapshot", elem_id="make-downloads"
                        )
                        files = gr.File(
                            label="Downloads (the snapshot opens at pytorch.org/memory_viz)",
                            file_count="multiple",
                            interactive=False,
                            elem_id="downloads",
                        )
        query = gr.Textbox(visible=False)
        pins = gr.State([])
        tab = gr.State("")  # the result tab shown (handlers.PICTURE_TAB, FIT_TAB, ...)

        inputs = [w[name] for name in h.INPUT_NAMES]
        estimate_outputs = [result, cli, query, message]
        detail_outputs = [interactive, plot, modules]

        last = "always_last"  # a change made while one is computed is computed next

        def refresh(event: Any) -> None:
            """Chain busy -> estimate -> done -> URL -> details -> fit and plan after
            ``event``."""
            event.then(None, None, None, js=BUSY_JS, trigger_mode=last).then(
                h.update,
                [pins, config_file, *inputs],
                estimate_outputs,
                show_progress="hidden",
                trigger_mode=last,
            ).then(None, None, None, js=DONE_JS, trigger_mode=last).then(
                None, [query], None, js=SET_URL_JS, trigger_mode=last
            ).then(
                h.details,
                [tab, config_file, *inputs],
                detail_outputs,
                show_progress="minimal",
                trigger_mode=last,
            ).then(h.fit_and_plan, [tab, config_file, *inputs], [fixes, plan], trigger_mode=last)

        triggers = [w[name].input for name in h.INPUT_NAMES]
        triggers += [config_file.upload, config_file.clear]
        refresh(gr.on(triggers, lambda: None, None, None, trigger_mode=last))

        def on_load(request: gr.Request) -> list[Any]:
            return h.load_query(dict(request.query_params))

        refresh(demo.load(on_load, None, [*inputs, pins, comparison, notice]))

        uploads = ((ds_file, "deepspeed"), (acc_file, "accelerate"), (trainer_file, "trainer"))
        for upload, kind in uploads:

            def apply(path: str | None, *raw: Any, kind: str = kind) -> list[Any]:
                return h.apply_framework_file(kind, path, *raw)

            refresh(upload.upload(apply, [upload, *inputs], [*inputs, notice]))

        refresh(pin_button.click(h.pin, [pins, config_file, *inputs], [pins, comparison, notice]))
        refresh(
            clear_button.click(lambda: ([], h.compare([]), ""), None, [pins, comparison, notice])
        )
        tabs = [
            (first_tab, ""),
            (picture_tab, h.PICTURE_TAB),
            (modules_tab, ""),
            (fit_tab, h.FIT_TAB),
            (compare_tab, ""),
            (downloads_tab, ""),
        ]
        for tab_block, name in tabs:
            selected = tab_block.select(lambda name=name: name, None, tab)
            if name == h.PICTURE_TAB:
                selected.then(h.details, [tab, config_file, *inputs], detail_outputs)
            elif name == h.FIT_TAB:
                selected.then(h.fit_and_plan, [tab, config_file, *inputs], [fixes, plan])
        download_button.click(h.downloads, [config_file, *inputs], [files, notice])
    return demo
