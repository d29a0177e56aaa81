"""Which dev-2 QLoRA rows run peft's ``prepare_model_for_kbit_training`` (issue 24, session 23).

Each stack's code was read at the rows' versions; the row's configuration (its jsonl reading plus
``benchmarks/dev2_causes.AMENDMENTS``, through ``trainmem estimate``'s own option parsing) must
resolve to what that code does (``TrainingConfig.kbit_fp32_upcast``):

- Answer.AI fsdp_qlora train.py (e4968fd, 50efa1e, 4cd6923; GT115-GT131): the ``qlora`` path
  builds the model with ``AutoModelForCausalLM.from_config`` under ``init_empty_weights``,
  swaps the linears for ``Linear4bit(..., quant_storage=torch_dtype)`` (``replace_linear``),
  and ``load_and_quantize`` loads every checkpoint tensor with ``dtype=torch_dtype``
  (``place_on_device``: ``value.to(device=device, dtype=dtype)``), bf16 for the rows' default
  ``precision='bf16'``; then ``get_peft_model``. No ``prepare_model_for_kbit_training``
  anywhere in the file at those commits, no autocast (``nullcontext`` for ``bf16``): the
  embeddings, norms and head stay bf16 and the residual stream too.
- torchtune (GT027, GT028, GT037, GT173) and litgpt (GT098-GT109): their own model code, no
  peft.
- TRL's ``SFTTrainer`` with a ``peft_config`` prepares only a base it does not see sharded
  (trl v0.8.6 / v0.13.0 trl/trainer/sft_trainer.py: ``is_sharded_qlora`` when the first
  ``Params4bit`` is on the CPU or the meta device, as accelerate's FSDP
  ``fsdp_cpu_ram_efficient_loading`` and ZeRO-3 load it): philschmid's FSDP run (GT114), peft's
  examples/sft FSDP / ZeRO-3 runs (GT176-GT178) and fms-acceleration's two-GPU FSDP rows
  (GT147, GT149, GT151, GT153, GT154: scripts/benchmarks/benchmark.py @24bdadb launches
  ``accelerate launch`` with accelerate.yaml, ``fsdp_cpu_ram_efficient_loading: true``) are not
  prepared; its one-GPU rows (GT146, GT148, GT150, GT152: ``COMMAND_PYTHON``, framework_config
  ``baseline-peft-bnb``, whose ``no_peft_model: true`` leaves the preparation to SFTTrainer,
  framework_plugin_bnb.py ``model_loader``'s warning) are.
- GPTQ bases (GT155-GT160): peft skips the fp32 cast (``KBIT_NOT_UPCAST``).
"""

from __future__ import annotations

import sys

import pytest

from conftest import REPO_DIR

BENCH = REPO_DIR / "benchmarks"
sys.path.insert(0, str(BENCH))

import validate  # noqa: E402

from trainmem.specs.training import TrainingConfig  # noqa: E402

PREPARED = {"GT146", "GT148", "GT150", "GT152"}
"""The dev-2 rows whose stack casts the non-quantized parameters to fp32 (TRL's SFTTrainer on
one GPU); every other quantized row's stack does not."""

FSDP_QLORA_ROWS = {
    "GT115": "llama-2-7b",
    "GT116": "llama-2-7b",
    "GT119": "llama-2-7b",
    "GT120": "llama-2-7b",
    "GT123": "llama-2-7b",
    "GT126": "llama-2-7b",
    "GT127": "yi-34b",
    "GT128": "yi-34b",
    "GT129": "llama-2-70b",
    "GT130": "mistral-7b-v0.1",
    "GT131": "mistral-7b-v0.1",
}
"""The QLoRA rows of fsdp_qlora's benchmarks_03_2024.md (the others are LoRA on a bf16 base)."""

EMBEDDING_BYTES = {
    # train.py load_and_quantize casts the checkpoint's embedding to bf16: 2 B x vocab x hidden
    # (config.json: Llama-2-7B 32000 x 4096, Yi-34B 64000 x 7168, Llama-2-70B 32000 x 8192,
    # Mistral-7B 32000 x 4096)
    "llama-2-7b": 2 * 32000 * 4096,
    "yi-34b": 2 * 64000 * 7168,
    "llama-2-70b": 2 * 32000 * 8192,
    "mistral-7b-v0.1": 2 * 32000 * 4096,
}

needs_dev2 = pytest.mark.skipif(
    not validate.DEV2_ARGS.exists(), reason="shared/validation/dev_measurements_2* not beside"
)


class _Resolved(Exception):
    """Raised by the stand-in estimate: the CLI resolved the row's TrainingConfig."""

    def __init__(self, training: TrainingConfig) -> None:
        super().__init__("resolved")
        self.training = training


def _resolve(args: list[str], monkeypatch: pytest.MonkeyPatch) -> TrainingConfig:
    """The TrainingConfig ``trainmem estimate ARGS`` builds (its own option parsing), without
    running an engine."""
    from typer.testing import CliRunner

    from trainmem.cli.app import app

    def stand_in(model: object, training: TrainingConfig, **_: object) -> None:
        raise _Resolved(training)

    import trainmem.estimate  # noqa: F401  (the module; the package's ``estimate`` is the function)

    monkeypatch.setattr(sys.modules["trainmem.estimate"], "estimate", stand_in)
    result = CliRunner().invoke(app, ["estimate", *args, "--json"])
    assert isinstance(result.exception, _Resolved), result.output
    return result.exception.training


def _quantized_rows() -> list[validate.Dev2Row]:
    rows = validate.load_dev2() if validate.DEV2_ARGS.exists() else []
    return [r for r in rows if r.args is not None and "--quantize-base" in [*r.args, *r.amend]]


@needs_dev2
def test_every_quantized_row_is_read_here() -> None:
    ids = {r.id for r in _quantized_rows()}
    assert PREPARED <= ids and set(FSDP_QLORA_ROWS) <= ids
    assert len(ids) == 42  # a new QLoRA row needs its stack read before it is guarded


@needs_dev2
@pytest.mark.parametrize("row", _quantized_rows(), ids=lambda r: r.id)
def test_the_k_bit_preparation_follows_the_rows_stack(
    row: validate.Dev2Row, monkeypatch: pytest.MonkeyPatch
) -> None:
    training = _resolve(validate.cli_args(row), monkeypatch)
    assert training.kbit_fp32_upcast == (row.id in PREPARED)


@needs_dev2
@pytest.mark.parametrize("row_id", sorted(FSDP_QLORA_ROWS))
def test_fsdp_qlora_rows_keep_a_bf16_base_and_stream(
    row_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainmem.analytic.activation_shapes import compute_and_residual_bytes
    from trainmem.analytic.tensor_states import tensor_states
    from trainmem.specs.hf import load_model_spec

    row = {r.id: r for r in _quantized_rows()}[row_id]
    training = _resolve(validate.cli_args(row), monkeypatch)
    assert training.framework == "fsdp-qlora" and training.precision == "bf16-true"
    assert not training.uses_autocast  # train.py: nullcontext() for precision 'bf16'
    assert not training.kbit_fp32_activations
    # bf16 activations and residual stream: no fp32 parameter feeds the layers
    assert compute_and_residual_bytes(training) == (2, 2)
    states = {s.name: s for s in tensor_states(load_model_spec(FSDP_QLORA_ROWS[row_id]), training)}
    assert states["embedding/tokens"].full_param_bytes == EMBEDDING_BYTES[FSDP_QLORA_ROWS[row_id]]
