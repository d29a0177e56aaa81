"""Read a Hugging Face ``config.json`` into a :class:`~trainmem.specs.model.ModelSpec`.

This is the only module that knows Hugging Face field names (``n_layer``,
``num_hidden_layers``, ``num_key_value_heads``, ``multi_query``...). Shipped presets are
plain ``config.json`` files in ``presets/`` and go through the same code path as a file a
user passes by path, so there is one loader, not two.

Each family translator mirrors the ``__init__`` of the transformers modules it describes
(``transformers/models/<family>/modeling_<family>.py``) and falls back to the defaults of
``configuration_<family>.py`` (transformers 5.x) for fields a config leaves out. The shape
fields (layers, width, heads, vocabulary, MLP width where the family has no rule for it)
are required: an estimate silently built on a library default would be worse than an error.

No network access happens here except for an ``org/name`` hub id that is neither a preset
nor a local path, and only when ``huggingface_hub`` is installed (``pip install
trainmem[hub]``).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.files import parse_json, path_kind, read_text_file, resolve_path
from trainmem.specs.model import MAX_COUNT, HeadKind, ModelSpec, describe_int

__all__ = [
    "PRESETS_DIR",
    "SUPPORTED_MODEL_TYPES",
    "list_presets",
    "load_hf_config",
    "load_model_spec",
    "model_spec_from_hf",
    "preset_index",
]

PRESETS_DIR = Path(__file__).parent / "presets"
"""Folder holding the shipped ``<preset>.json`` configs and ``index.json``."""

Config = Mapping[str, Any]


# ---------------------------------------------------------------------------------------
# Finding and reading a config
# ---------------------------------------------------------------------------------------


def preset_index() -> dict[str, dict[str, str | None]]:
    """The preset index: preset name -> ``{"file", "hub_id", "source"}``.

    Returns:
        A fresh dict read from ``presets/index.json``; ``hub_id`` is None for the tiny
        test configs that exist only here.
    """
    with (PRESETS_DIR / "index.json").open(encoding="utf-8") as f:
        index: dict[str, dict[str, str | None]] = json.load(f)
    return index


def list_presets() -> list[str]:
    """Names of the shipped model presets, sorted.

    Returns:
        Preset names accepted by :func:`load_hf_config` (``"gpt2"``, ``"llama-3.1-8b"``...).
    """
    return sorted(preset_index())


def _read_json(path: Path) -> dict[str, Any]:
    data = parse_json(read_text_file(path, "model"), str(path)[:200], "model")
    if not isinstance(data, dict):
        raise SpecError(
            "model",
            f"{str(path)[:200]} holds a JSON {type(data).__name__}, expected an object "
            "(a Hugging Face config.json)",
        )
    return data


def _short(value: object) -> str:
    """A config value for an error message, at most about 80 characters."""
    if isinstance(value, int) and not isinstance(value, bool):
        return describe_int(value)
    text = (
        repr(value) if isinstance(value, str | float | bool | None) else f"a {type(value).__name__}"
    )
    return text if len(text) <= 80 else text[:77] + "..."


HUB_PROBE_SECONDS = 1.5
"""How long to wait for the Hub's address and a TCP connection before calling it offline."""


def _hub_unreachable(endpoint: str) -> str | None:
    """None if a TCP connection to the Hub's host opens within :data:`HUB_PROBE_SECONDS`, else
    why not. ``huggingface_hub`` itself retries a dead network for about 25 s; this answers in
    under 2. Name resolution runs in a daemon thread because ``getaddrinfo`` has no timeout."""
    import socket
    import threading
    import time
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint)
    host = parts.hostname or "huggingface.co"
    port = parts.port or (80 if parts.scheme == "http" else 443)
    found: list[Any] = []

    def resolve() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=resolve, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_SECONDS)
    if not found:
        return f"no answer resolving {host} within {HUB_PROBE_SECONDS} s"
    if isinstance(found[0], OSError):
        return f"cannot resolve {host}: {found[0]}"
    family, kind, proto, _, address = found[0][0]
    left = max(HUB_PROBE_SECONDS - (time.monotonic() - start), 0.1)
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(left)
            sock.connect(address)
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc.strerror or exc}"
    return None


def _from_hub(repo_id: str) -> dict[str, Any]:
    import os

    how = (
        "download its config.json (e.g. on a machine with network access) and pass the path, "
        "or use a preset (`trainmem models`)"
    )
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise SpecError(
            "model", f"{repo_id!r} is not a preset or a local path and HF_HUB_OFFLINE is set; {how}"
        )
    try:
        from huggingface_hub import hf_hub_download  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise SpecError(
            "model",
            f"{repo_id!r} is not a preset or a local path; to read it from the Hugging Face "
            "Hub install the hub extra (pip install 'trainmem[hub]'), or download its "
            "config.json and pass the path. List presets with `trainmem models`.",
        ) from exc
    reason = _hub_unreachable(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    if reason is not None:
        raise SpecError(
            "model",
            f"{repo_id!r} is not a preset or a local path and the Hugging Face Hub is "
            f"unreachable ({reason}); {how}",
        )
    try:
        path = hf_hub_download(repo_id=repo_id, filename="config.json", etag_timeout=5)
    except Exception as exc:  # any hub failure (network, 404, auth) becomes one clear line
        raise SpecError(
            "model",
            f"could not fetch config.json of {repo_id!r} from the Hugging Face Hub "
            f"({type(exc).__name__}); pass a local path to its config.json instead",
        ) from exc
    return _read_json(Path(path))


def load_hf_config(name_or_path: str) -> dict[str, Any]:
    """Load a Hugging Face config dict by preset name, path, or hub id.

    Resolution order: a shipped preset name (``"llama-3.1-8b"``) or the hub id a preset was
    taken from (``"meta-llama/Llama-3.1-8B"``, case-insensitive, served offline); an
    existing path to a ``config.json`` or to a folder holding one; an ``org/name`` hub id,
    fetched with ``huggingface_hub`` only if it is installed.

    Args:
        name_or_path: preset name, file or folder path, or hub id.

    Returns:
        The parsed ``config.json`` as a dict.

    Raises:
        SpecError: unknown preset (with close names), unreadable or non-JSON file, folder
            without ``config.json``, or a hub id that cannot be fetched.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise SpecError(
            "model",
            f"must be a preset name, a config.json path or a hub id, got {_short(name_or_path)}",
        )
    index = preset_index()
    by_hub_id = {str(e["hub_id"]).lower(): name for name, e in index.items() if e["hub_id"]}
    preset = name_or_path if name_or_path in index else by_hub_id.get(name_or_path.lower())
    if preset is not None:
        return _read_json(PRESETS_DIR / str(index[preset]["file"]))

    path = resolve_path(name_or_path, "model")
    kind = path_kind(path)
    if kind == "dir":
        config_file = path / "config.json"
        if path_kind(config_file) is None:
            raise SpecError("model", f"folder {str(path)[:200]} has no config.json")
        return _read_json(config_file)
    if kind == "file":
        return _read_json(path)

    looks_like_path = name_or_path.endswith(".json") or name_or_path.startswith((".", "/", "~"))
    if not looks_like_path and name_or_path.count("/") == 1:
        return _from_hub(name_or_path)

    close = difflib.get_close_matches(name_or_path[:100].lower(), list(index), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    what = "file or folder not found" if looks_like_path else "unknown model preset"
    raise SpecError(
        "model",
        f"{what} {_short(name_or_path)}; {hint}list presets with `trainmem models`, "
        "or pass the path to a Hugging Face config.json",
    )


def load_model_spec(name_or_path: str) -> ModelSpec:
    """Load a preset, config file or hub id straight into a ModelSpec.

    Args:
        name_or_path: anything :func:`load_hf_config` accepts.

    Returns:
        The spec, named after ``name_or_path``.
    """
    return model_spec_from_hf(load_hf_config(name_or_path), name=name_or_path)


# ---------------------------------------------------------------------------------------
# Field helpers
# ---------------------------------------------------------------------------------------


class _Fields:
    """Typed, validating access to one config dict; errors name the HF field."""

    def __init__(self, config: Config, model_type: str) -> None:
        self.config = config
        self.model_type = model_type

    def _missing(self, key: str) -> SpecError:
        return SpecError(
            key, f"required field missing from the config (model_type={self.model_type!r})"
        )

    def positive_int(self, key: str, default: int | None = None) -> int:
        """A required (or defaulted) positive integer field."""
        value = self.config.get(key)
        if value is None:
            if default is None:
                raise self._missing(key)
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SpecError(key, f"must be a positive integer, got {_short(value)}")
        if value > MAX_COUNT:
            raise SpecError(
                key, f"must be at most {MAX_COUNT:,} (2^31 - 1), got {describe_int(value)}"
            )
        return value

    def first_int(self, keys: tuple[str, ...], default: int | None = None) -> int:
        """The first present of several aliases (``n_embd`` / ``hidden_size``)."""
        for key in keys:
            if self.config.get(key) is not None:
                return self.positive_int(key)
        if default is None:
            raise self._missing(keys[0])
        return default

    def flag(self, key: str, default: bool) -> bool:
        """A boolean field."""
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SpecError(key, f"must be true or false, got {_short(value)}")
        return value

    def prob(self, key: str, default: float = 0.0) -> float:
        """A dropout probability in [0, 1]."""
        value = self.config.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise SpecError(key, f"must be a probability in [0, 1], got {_short(value)}")
        return float(value)

    def fraction(self, key: str, default: float) -> float:
        """A fraction in (0, 1] (partial rotary)."""
        value = self.config.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            raise SpecError(key, f"must be in (0, 1], got {_short(value)}")
        return float(value)

    def string(self, key: str, default: str) -> str:
        """A string field (activation names)."""
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise SpecError(key, f"must be a string, got {_short(value)}")
        return value

    def head_dim(self, hidden: int, heads: int, heads_key: str, hidden_key: str) -> int:
        """``head_dim`` if given, else hidden / heads, which must divide."""
        if self.config.get("head_dim") is not None:
            return self.positive_int("head_dim")
        if hidden % heads != 0:
            raise SpecError(
                heads_key,
                f"{heads} attention heads do not divide {hidden_key}={hidden}; "
                "fix the config or give head_dim",
            )
        return hidden // heads

    def kv_heads(self, key: str, heads: int, default: int | None = None) -> int:
        """KV heads (GQA); they must divide the query heads."""
        kv = self.positive_int(key, default if default is not None else heads)
        if heads % kv != 0:
            raise SpecError(key, f"{kv} must divide num_attention_heads={heads}")
        return kv


# ---------------------------------------------------------------------------------------
# Head (task) from `architectures`
# ---------------------------------------------------------------------------------------

_HEAD_SUFFIXES: tuple[tuple[str, HeadKind], ...] = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForMaskedLM", "masked-lm"),
    ("ForSequenceClassification", "sequence-classification"),
    ("ForImageClassification", "image-classification"),
)


def _head(fields: _Fields, default: HeadKind) -> tuple[HeadKind, int]:
    """Head kind from ``architectures[0]`` and its label count.

    ``FooModel`` (no ``For``) is the bare trunk, head ``none``. Labels come from
    ``id2label`` if present, else ``num_labels``, else transformers' default of 2.
    """
    architectures = fields.config.get("architectures")
    head: HeadKind = default
    if architectures:
        if not isinstance(architectures, list) or not isinstance(architectures[0], str):
            raise SpecError(
                "architectures", f"must be a list of class names, got {_short(architectures)}"
            )
        arch = architectures[0]
        for suffix, kind in _HEAD_SUFFIXES:
            if arch.endswith(suffix):
                head = kind
                break
        else:
            if arch.endswith("Model") and "For" not in arch:
                head = "none"
            else:
                supported = ", ".join(s for s, _ in _HEAD_SUFFIXES)
                raise UnsupportedError(
                    f"architectures: head {_short(arch)} is not modelled (supported: classes "
                    f"ending in {supported}, or a bare XModel); edit 'architectures' in the config "
                    "to the closest supported class, or use --engine trace"
                )
    if head not in ("sequence-classification", "image-classification"):
        return head, 0
    id2label = fields.config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return head, len(id2label)
    return head, fields.positive_int("num_labels", 2)


# ---------------------------------------------------------------------------------------
# Family translators. Each returns the keyword arguments of ModelSpec.
# ---------------------------------------------------------------------------------------


def _gpt2(f: _Fields) -> dict[str, Any]:
    """GPT-2: transformers/models/gpt2/modeling_gpt2.py (GPT2Attention, GPT2MLP)."""
    h = f.positive_int("n_embd")
    a = f.positive_int("n_head")
    inner = f.config.get("n_inner")
    head, num_labels = _head(f, "causal-lm")
    return dict(
        architecture="decoder",
        num_layers=f.positive_int("n_layer"),
        hidden_size=h,
        num_heads=a,
        num_kv_heads=a,
        head_dim=f.head_dim(h, a, "n_head", "n_embd"),
        # GPT2MLP: inner_dim = n_inner if not None else 4 * hidden_size
        intermediate_size=4 * h if inner is None else f.positive_int("n_inner"),
        mlp_kind="gelu",
        hidden_act=f.string("activation_function", "gelu_new"),
        norm_kind="layernorm",
        vocab_size=f.positive_int("vocab_size"),
        max_position_embeddings=f.positive_int("n_positions", 1024),
        position_kind="learned",
        tie_word_embeddings=f.flag("tie_word_embeddings", True),
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        fused_qkv=True,
        head=head,
        num_labels=num_labels,
        hidden_dropout=f.prob("resid_pdrop", 0.1),
        attention_dropout=f.prob("attn_pdrop", 0.1),
        embedding_dropout=f.prob("embd_pdrop", 0.1),
    )


def _bert(f: _Fields) -> dict[str, Any]:
    """BERT: transformers/models/bert/modeling_bert.py (BertEmbeddings, BertLayer)."""
    position_type = f.string("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise UnsupportedError(
            f"position_embedding_type: {position_type!r} (relative position embeddings) is "
            "not modelled, only 'absolute'; use --engine trace"
        )
    h = f.positive_int("hidden_size")
    a = f.positive_int("num_attention_heads")
    head, num_labels = _head(f, "masked-lm")
    dropout = f.prob("hidden_dropout_prob", 0.1)
    return dict(
        architecture="encoder",
        num_layers=f.positive_int("num_hidden_layers"),
        hidden_size=h,
        num_heads=a,
        num_kv_heads=a,
        head_dim=f.head_dim(h, a, "num_attention_heads", "hidden_size"),
        intermediate_size=f.positive_int("intermediate_size"),
        mlp_kind="gelu",
        hidden_act=f.string("hidden_act", "gelu"),
        norm_kind="layernorm",
        vocab_size=f.positive_int("vocab_size"),
        max_position_embeddings=f.positive_int("max_position_embeddings", 512),
        position_kind="learned",
        tie_word_embeddings=f.flag("tie_word_embeddings", True),
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        # Post-LN: BertSelfOutput.LayerNorm and BertOutput.LayerNorm, no final norm.
        final_norm=False,
        embedding_norm=True,
        head=head,
        num_labels=num_labels,
        type_vocab_size=f.positive_int("type_vocab_size", 2),
        hidden_dropout=dropout,
        attention_dropout=f.prob("attention_probs_dropout_prob", 0.1),
        embedding_dropout=dropout,
    )


def _llama_like(
    f: _Fields,
    *,
    kv_default: int | None = None,
    qkv_bias: bool | None = None,
    hidden_act_key: str = "hidden_act",
    act_default: str = "silu",
    max_positions: int = 2048,
    tie_default: bool = False,
    head_dim_default: int | None = None,
    num_norms: int = 2,
    qk_norm: bool = False,
) -> dict[str, Any]:
    """Llama-style gated decoder (Llama, Mistral, Mixtral, Qwen2/3, Gemma/2).

    Mirrors transformers/models/llama/modeling_llama.py (LlamaAttention, LlamaMLP,
    LlamaDecoderLayer). ``qkv_bias`` None means the config's ``attention_bias`` decides
    q/k/v/o biases together (Llama, Gemma, Qwen3); True means q/k/v biased, o not (Qwen2).
    """
    h = f.positive_int("hidden_size")
    a = f.positive_int("num_attention_heads")
    if f.config.get("head_dim") is None and head_dim_default is not None:
        d = head_dim_default
    else:
        d = f.head_dim(h, a, "num_attention_heads", "hidden_size")
    attention_bias = f.flag("attention_bias", False)
    head, num_labels = _head(f, "causal-lm")
    return dict(
        architecture="decoder",
        num_layers=f.positive_int("num_hidden_layers"),
        hidden_size=h,
        num_heads=a,
        num_kv_heads=f.kv_heads("num_key_value_heads", a, kv_default),
        head_dim=d,
        intermediate_size=f.positive_int("intermediate_size"),
        mlp_kind="gated",
        hidden_act=f.string(hidden_act_key, act_default),
        norm_kind="rmsnorm",
        vocab_size=f.positive_int("vocab_size"),
        max_position_embeddings=f.positive_int("max_position_embeddings", max_positions),
        position_kind="rotary",
        tie_word_embeddings=f.flag("tie_word_embeddings", tie_default),
        attention_bias=attention_bias if qkv_bias is None else qkv_bias,
        attention_out_bias=attention_bias if qkv_bias is None else False,
        mlp_bias=f.flag("mlp_bias", False),
        norm_bias=False,
        num_norms_per_layer=num_norms,
        qk_norm=qk_norm,
        head=head,
        num_labels=num_labels,
        attention_dropout=f.prob("attention_dropout", 0.0),
    )


def _llama(f: _Fields) -> dict[str, Any]:
    """Llama: transformers/models/llama/configuration_llama.py defaults."""
    return _llama_like(f)


def _mistral(f: _Fields) -> dict[str, Any]:
    """Mistral: transformers/models/mistral (no biases, kv default 8, 4096 * 32 positions)."""
    spec = _llama_like(f, kv_default=8, qkv_bias=False, max_positions=4096 * 32)
    spec["mlp_bias"] = False
    return spec


def _mixtral(f: _Fields) -> dict[str, Any]:
    """Mixtral: transformers/models/mixtral/modeling_mixtral.py (MixtralSparseMoeBlock).

    Router ``gate`` is Linear(h, E, bias=False); each expert is a gated MLP of width
    ``intermediate_size``.
    """
    spec = _mistral(f)
    num_experts = f.positive_int("num_local_experts", 8)
    top_k = f.positive_int("num_experts_per_tok", 2)
    if top_k > num_experts:
        raise SpecError("num_experts_per_tok", f"{top_k} exceeds num_local_experts={num_experts}")
    spec.update(num_experts=num_experts, num_experts_per_tok=top_k)
    return spec


def _qwen2(f: _Fields) -> dict[str, Any]:
    """Qwen2: transformers/models/qwen2/modeling_qwen2.py (q/k/v bias=True, o_proj no bias)."""
    spec = _llama_like(f, kv_default=32, qkv_bias=True, max_positions=32768)
    spec["mlp_bias"] = False
    return spec


def _qwen3(f: _Fields) -> dict[str, Any]:
    """Qwen3: transformers/models/qwen3/modeling_qwen3.py (q_norm / k_norm RMSNorm(head_dim))."""
    spec = _llama_like(f, kv_default=32, max_positions=32768, head_dim_default=128, qk_norm=True)
    spec["mlp_bias"] = False
    return spec


def _gemma(f: _Fields) -> dict[str, Any]:
    """Gemma: transformers/models/gemma/modeling_gemma.py (GeGLU, tied, head_dim 256)."""
    spec = _llama_like(
        f,
        kv_default=16,
        act_default="gelu_pytorch_tanh",
        max_positions=8192,
        tie_default=True,
        head_dim_default=256,
    )
    spec["mlp_bias"] = False
    if spec["hidden_act"] == "gelu":
        # GemmaConfig rewrites the legacy "gelu" of the official releases to the tanh
        # approximation the model was trained with.
        spec["hidden_act"] = "gelu_pytorch_tanh"
    return spec


def _gemma2(f: _Fields) -> dict[str, Any]:
    """Gemma-2: transformers/models/gemma2/modeling_gemma2.py (4 RMSNorms per layer)."""
    spec = _llama_like(
        f,
        kv_default=4,
        hidden_act_key="hidden_activation",
        act_default="gelu_pytorch_tanh",
        max_positions=8192,
        tie_default=True,
        head_dim_default=256,
        num_norms=4,
    )
    spec["mlp_bias"] = False
    return spec


def _phi(f: _Fields) -> dict[str, Any]:
    """Phi-1/1.5/2: transformers/models/phi/modeling_phi.py (PhiAttention, PhiMLP).

    One shared ``input_layernorm`` feeds attention and MLP in parallel; every linear has a
    bias, including ``lm_head``; ``qk_layernorm`` adds LayerNorm(head_dim) on q and k.
    """
    h = f.positive_int("hidden_size")
    a = f.positive_int("num_attention_heads")
    head, num_labels = _head(f, "causal-lm")
    return dict(
        architecture="decoder",
        num_layers=f.positive_int("num_hidden_layers"),
        hidden_size=h,
        num_heads=a,
        num_kv_heads=f.kv_heads("num_key_value_heads", a),
        head_dim=f.head_dim(h, a, "num_attention_heads", "hidden_size"),
        intermediate_size=f.positive_int("intermediate_size"),
        mlp_kind="gelu",
        hidden_act=f.string("hidden_act", "gelu_new"),
        norm_kind="layernorm",
        vocab_size=f.positive_int("vocab_size"),
        max_position_embeddings=f.positive_int("max_position_embeddings", 2048),
        position_kind="rotary",
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        parallel_attention=True,
        num_norms_per_layer=1,
        qk_norm=f.flag("qk_layernorm", False),
        lm_head_bias=True,
        partial_rotary_factor=f.fraction("partial_rotary_factor", 0.5),
        head=head,
        num_labels=num_labels,
        hidden_dropout=f.prob("resid_pdrop", 0.0),
        attention_dropout=f.prob("attention_dropout", 0.0),
        embedding_dropout=f.prob("embd_pdrop", 0.0),
    )


def _falcon(f: _Fields) -> dict[str, Any]:
    """Falcon: transformers/models/falcon/modeling_falcon.py (FalconAttention, FalconDecoderLayer).

    Fused ``query_key_value`` of width (a + 2k) * d where k = ``num_kv_heads`` for the new
    decoder architecture (40B/180B), 1 for ``multi_query`` (7B), else a. Parallel blocks
    share one ``input_layernorm`` unless the new architecture has ``ln_attn`` and
    ``ln_mlp`` (``num_ln_in_parallel_attn`` 2, its default there).
    """
    h = f.first_int(("hidden_size", "n_embed"))
    a = f.first_int(("num_attention_heads", "n_head"))
    d = f.head_dim(h, a, "num_attention_heads", "hidden_size")
    new_arch = f.flag("new_decoder_architecture", False)
    multi_query = f.flag("multi_query", True)
    if new_arch:
        kv = f.kv_heads("num_kv_heads", a)
    elif multi_query:
        kv = 1
    else:
        kv = a
    parallel = f.flag("parallel_attn", True)
    if not parallel:
        num_norms = 2
    else:
        default_lns = 2 if new_arch else 1
        num_norms = f.positive_int("num_ln_in_parallel_attn", default_lns)
    bias = f.flag("bias", False)
    alibi = f.flag("alibi", False)
    head, num_labels = _head(f, "causal-lm")
    if f.flag("apply_residual_connection_post_layernorm", False):
        raise UnsupportedError(
            "apply_residual_connection_post_layernorm: true is not modelled; use --engine trace"
        )
    return dict(
        architecture="decoder",
        num_layers=f.first_int(("num_hidden_layers", "n_layer")),
        hidden_size=h,
        num_heads=a,
        num_kv_heads=kv,
        head_dim=d,
        intermediate_size=f.positive_int("ffn_hidden_size", 4 * h),
        mlp_kind="gelu",
        hidden_act=f.string("activation", "gelu"),
        norm_kind="layernorm",
        vocab_size=f.positive_int("vocab_size"),
        max_position_embeddings=f.positive_int("max_position_embeddings", 2048),
        position_kind="alibi" if alibi else "rotary",
        tie_word_embeddings=f.flag("tie_word_embeddings", True),
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=bias,
        parallel_attention=parallel,
        fused_qkv=True,
        num_norms_per_layer=num_norms,
        head=head,
        num_labels=num_labels,
        hidden_dropout=f.prob("hidden_dropout", 0.0),
        attention_dropout=f.prob("attention_dropout", 0.0),
    )


def _gpt_neox(f: _Fields) -> dict[str, Any]:
    """GPT-NeoX / StableLM-alpha: transformers/models/gpt_neox/modeling_gpt_neox.py.

    Fused ``query_key_value`` (3h), two LayerNorms per layer even with the parallel
    residual, biases on every linear (``attention_bias`` for the attention ones).
    """
    h = f.positive_int("hidden_size")
    a = f.positive_int("num_attention_heads")
    attention_bias = f.flag("attention_bias", True)
    rope = f.config.get("rope_parameters")
    rotary_key = "rotary_pct"
    if f.config.get("rotary_pct") is None and isinstance(rope, dict):
        rotary = _Fields(rope, f.model_type).fraction("partial_rotary_factor", 0.25)
    else:
        rotary = f.fraction(rotary_key, 0.25)
    head, num_labels = _head(f, "causal-lm")
    return dict(
        architecture="decoder",
        num_layers=f.positive_int("num_hidden_layers"),
        hidden_size=h,
        num_heads=a,
        num_kv_heads=a,
        head_dim=f.head_dim(h, a, "num_attention_heads", "hidden_size"),
        intermediate_size=f.positive_int("intermediate_size"),
        mlp_kind="gelu",
        hidden_act=f.string("hidden_act", "gelu"),
        norm_kind="layernorm",
        vocab_size=f.positive_int("vocab_size"),
        max_position_embeddings=f.positive_int("max_position_embeddings", 2048),
        position_kind="rotary",
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        attention_bias=attention_bias,
        attention_out_bias=attention_bias,
        mlp_bias=True,
        parallel_attention=f.flag("use_parallel_residual", True),
        fused_qkv=True,
        partial_rotary_factor=rotary,
        head=head,
        num_labels=num_labels,
        hidden_dropout=f.prob("hidden_dropout", 0.0),
        attention_dropout=f.prob("attention_dropout", 0.0),
    )


def _square(f: _Fields, key: str, default: int) -> int:
    value = f.config.get(key)
    if isinstance(value, list | tuple):
        if len(value) != 2 or value[0] != value[1]:
            raise UnsupportedError(
                f"{key}: non-square {_short(value)} is not modelled; use --engine trace"
            )
        return _Fields({key: value[0]}, f.model_type).positive_int(key)
    return f.positive_int(key, default)


def _vit(f: _Fields) -> dict[str, Any]:
    """ViT: transformers/models/vit/modeling_vit.py (ViTEmbeddings, ViTLayer, ViTPooler)."""
    h = f.positive_int("hidden_size")
    a = f.positive_int("num_attention_heads")
    image = _square(f, "image_size", 224)
    patch = _square(f, "patch_size", 16)
    if patch > image:
        raise SpecError("patch_size", f"{patch} is larger than image_size={image}")
    head, num_labels = _head(f, "none")
    dropout = f.prob("hidden_dropout_prob", 0.0)
    pooler = f.config.get("pooler_output_size")
    return dict(
        architecture="vision-encoder",
        num_layers=f.positive_int("num_hidden_layers"),
        hidden_size=h,
        num_heads=a,
        num_kv_heads=a,
        head_dim=f.head_dim(h, a, "num_attention_heads", "hidden_size"),
        intermediate_size=f.positive_int("intermediate_size"),
        mlp_kind="gelu",
        hidden_act=f.string("hidden_act", "gelu"),
        norm_kind="layernorm",
        vocab_size=0,
        # ViTEmbeddings.position_embeddings: [1, num_patches + 1, h] (the +1 is [CLS]).
        max_position_embeddings=(image // patch) ** 2 + 1,
        position_kind="learned",
        tie_word_embeddings=False,
        attention_bias=f.flag("qkv_bias", True),
        attention_out_bias=True,
        mlp_bias=True,
        head=head,
        num_labels=num_labels,
        image_size=image,
        patch_size=patch,
        num_channels=f.positive_int("num_channels", 3),
        pooler_output_size=None if pooler is None else f.positive_int("pooler_output_size"),
        hidden_dropout=dropout,
        attention_dropout=f.prob("attention_probs_dropout_prob", 0.0),
        embedding_dropout=dropout,
    )


# ---------------------------------------------------------------------------------------
# Issue 15 families (helper "hardfamilies"): DeepSeek-V3, T5, CLIP / SigLIP / DINOv2 vision
# towers. Kept in one block so they can become rows of the attribute_map table.
# ---------------------------------------------------------------------------------------


def _bare_vision_tower(f: _Fields, model_class: str) -> None:
    """Vision towers are modelled as the bare ``XVisionModel`` / ``Dinov2Model`` (head
    ``none``); other classes (with a projection or a classifier) are refused by name."""
    architectures = f.config.get("architectures")
    if not architectures:
        return
    if not isinstance(architectures, list) or not isinstance(architectures[0], str):
        raise SpecError(
            "architectures", f"must be a list of class names, got {_short(architectures)}"
        )
    if architectures[0] != model_class:
        raise UnsupportedError(
            f"architectures: {_short(architectures[0])} is not modelled for model_type "
            f"{f.model_type!r}, only the bare {model_class}; use --engine trace"
        )


def _vision_tower(f: _Fields, *, default_patch: int, default_act: str) -> dict[str, Any]:
    """Fields CLIP, SigLIP and DINOv2 vision configs share (``hidden_size``, heads, image and
    patch sides, ``attention_dropout``)."""
    h = f.positive_int("hidden_size")
    a = f.positive_int("num_attention_heads")
    image = _square(f, "image_size", 224)
    patch = _square(f, "patch_size", default_patch)
    if patch > image:
        raise SpecError("patch_size", f"{patch} is larger than image_size={image}")
    return dict(
        architecture="vision-encoder",
        num_layers=f.positive_int("num_hidden_layers"),
        hidden_size=h,
        num_heads=a,
        num_kv_heads=a,
        head_dim=f.head_dim(h, a, "num_attention_heads", "hidden_size"),
        mlp_kind="gelu",
        hidden_act=f.string("hidden_act", default_act),
        norm_kind="layernorm",
        vocab_size=0,
        position_kind="learned",
        tie_word_embeddings=False,
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        head="none",
        image_size=image,
        patch_size=patch,
        num_channels=f.positive_int("num_channels", 3),
    )


def _clip_vision_model(f: _Fields) -> dict[str, Any]:
    """CLIP vision tower: transformers/models/clip/modeling_clip.py ``CLIPVisionModel``
    (``CLIPVisionEmbeddings``: bias-free patch conv, ``class_embedding``, positions for
    patches + 1; ``pre_layrnorm``; ``CLIPEncoderLayer``; ``post_layernorm`` on [CLS] only)."""
    _bare_vision_tower(f, "CLIPVisionModel")
    out = _vision_tower(f, default_patch=32, default_act="quick_gelu")
    out.update(
        intermediate_size=f.positive_int("intermediate_size"),
        max_position_embeddings=(out["image_size"] // out["patch_size"]) ** 2 + 1,
        patch_bias=False,
        embedding_norm=True,
        final_norm=False,
        vision_pooler="cls-norm",
        attention_dropout=f.prob("attention_dropout", 0.0),
    )
    return out


def _siglip_vision_model(f: _Fields) -> dict[str, Any]:
    """SigLIP vision tower: transformers/models/siglip/modeling_siglip.py
    ``SiglipVisionModel`` (no class token, ``post_layernorm`` on every patch, the
    ``SiglipMultiheadAttentionPoolingHead`` when ``vision_use_head``)."""
    _bare_vision_tower(f, "SiglipVisionModel")
    out = _vision_tower(f, default_patch=16, default_act="gelu_pytorch_tanh")
    out.update(
        intermediate_size=f.positive_int("intermediate_size"),
        max_position_embeddings=(out["image_size"] // out["patch_size"]) ** 2,
        class_token=False,
        vision_pooler="attention-probe" if f.flag("vision_use_head", True) else "cls",
        attention_dropout=f.prob("attention_dropout", 0.0),
    )
    if out["vision_pooler"] == "cls":
        raise UnsupportedError(
            "vision_use_head: false (a SigLIP tower without its pooling head) is not "
            "modelled; use --engine trace"
        )
    return out


def _dinov2(f: _Fields) -> dict[str, Any]:
    """DINOv2: transformers/models/dinov2/modeling_dinov2.py ``Dinov2Model`` (``cls_token``,
    ``mask_token``, positions for patches + 1; ``Dinov2Layer`` with ``Dinov2LayerScale`` on
    both branches; ``Dinov2MLP`` of ``int(hidden_size * mlp_ratio)`` or, with
    ``use_swiglu_ffn``, ``Dinov2SwiGLUFFN`` of ``(int(int(h * mlp_ratio) * 2 / 3) + 7) // 8 *
    8``; final ``layernorm``, pooled output = its [CLS] row)."""
    _bare_vision_tower(f, "Dinov2Model")
    out = _vision_tower(f, default_patch=14, default_act="gelu")
    ratio = f.config.get("mlp_ratio", 4)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or ratio <= 0:
        raise SpecError("mlp_ratio", f"must be a positive number, got {_short(ratio)}")
    hidden = int(out["hidden_size"] * ratio)
    swiglu = f.flag("use_swiglu_ffn", False)
    if swiglu:
        hidden = (int(hidden * 2 / 3) + 7) // 8 * 8
    if f.prob("drop_path_rate", 0.0) > 0:
        raise UnsupportedError(
            "drop_path_rate > 0 (stochastic depth) is not modelled; set it to 0 or use "
            "--engine trace"
        )
    dropout = f.prob("hidden_dropout_prob", 0.0)
    out.update(
        intermediate_size=hidden,
        mlp_kind="gated" if swiglu else "gelu",
        hidden_act="silu" if swiglu else out["hidden_act"],
        max_position_embeddings=(out["image_size"] // out["patch_size"]) ** 2 + 1,
        attention_bias=f.flag("qkv_bias", True),
        mask_token=f.flag("use_mask_token", True),
        layer_scale=True,
        vision_pooler="cls",
        hidden_dropout=dropout,
        attention_dropout=f.prob("attention_probs_dropout_prob", 0.0),
        embedding_dropout=dropout,
    )
    return out


def _deepseek_v3(f: _Fields) -> dict[str, Any]:
    """DeepSeek-V3: transformers/models/deepseek_v3/modeling_deepseek_v3.py
    (``DeepseekV3Attention``: multi-head latent attention; ``DeepseekV3MoE``: routed experts of
    ``moe_intermediate_size`` plus ``n_shared_experts`` shared ones; the first
    ``first_k_dense_replace`` blocks use ``DeepseekV3MLP`` of ``intermediate_size``). The
    multi-token-prediction module (``num_nextn_predict_layers``) is not part of transformers'
    model and is not counted."""
    h = f.positive_int("hidden_size")
    a = f.positive_int("num_attention_heads")
    layers = f.positive_int("num_hidden_layers")
    rope = f.positive_int("qk_rope_head_dim", 64)
    nope = f.positive_int("qk_nope_head_dim", 128)
    experts = f.positive_int("n_routed_experts", 256)
    first_dense = f.config.get("first_k_dense_replace", 3)
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise SpecError(
            "first_k_dense_replace", f"must be a non-negative integer, got {_short(first_dense)}"
        )
    if first_dense > layers:
        raise SpecError(
            "first_k_dense_replace",
            f"{first_dense} is more than num_hidden_layers={layers}",
        )
    q_rank = f.config.get("q_lora_rank", 1536)
    head, num_labels = _head(f, "causal-lm")
    return dict(
        architecture="decoder",
        num_layers=layers,
        hidden_size=h,
        num_heads=a,
        # MLA expands the latent to per-head keys and values (kv_b_proj): all a heads
        num_kv_heads=a,
        head_dim=nope + rope,
        intermediate_size=f.positive_int("moe_intermediate_size", 2048),
        mlp_kind="gated",
        hidden_act=f.string("hidden_act", "silu"),
        norm_kind="rmsnorm",
        vocab_size=f.positive_int("vocab_size"),
        max_position_embeddings=f.positive_int("max_position_embeddings", 4096),
        position_kind="rotary",
        partial_rotary_factor=rope / (nope + rope),
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        attention_bias=f.flag("attention_bias", False),
        attention_out_bias=f.flag("attention_bias", False),
        num_experts=experts,
        num_experts_per_tok=f.positive_int("num_experts_per_tok", 8),
        q_lora_rank=0 if q_rank is None else f.positive_int("q_lora_rank"),
        kv_lora_rank=f.positive_int("kv_lora_rank", 512),
        qk_rope_head_dim=rope,
        v_head_dim=f.positive_int("v_head_dim", 128),
        shared_expert_intermediate_size=(
            f.positive_int("moe_intermediate_size", 2048) * f.positive_int("n_shared_experts")
            if f.config.get("n_shared_experts", 1) not in (None, 0)
            else 0
        ),
        dense_layers=first_dense,
        dense_intermediate_size=f.positive_int("intermediate_size", 18432),
        head=head,
        num_labels=num_labels,
        attention_dropout=f.prob("attention_dropout", 0.0),
    )


def _t5(f: _Fields) -> dict[str, Any]:
    """T5 / Flan-T5: transformers/models/t5/modeling_t5.py ``T5ForConditionalGeneration``
    (shared embedding tied to both stacks' ``embed_tokens``; ``T5Block``: self-attention,
    cross-attention in the decoder, ``T5DenseActDense`` (``relu``) or
    ``T5DenseGatedActDense`` (``gated-gelu``, Flan-T5 / T5 v1.1); RMS-style ``T5LayerNorm``
    without bias; ``relative_attention_bias`` in the first block of each stack)."""
    architectures = f.config.get("architectures")
    if architectures and (
        not isinstance(architectures, list) or architectures[0] != "T5ForConditionalGeneration"
    ):
        raise UnsupportedError(
            f"architectures: {_short(architectures)} is not modelled for model_type 't5', only "
            "T5ForConditionalGeneration; use --engine trace"
        )
    d = f.positive_int("d_model")
    a = f.positive_int("num_heads", 8)
    projection = f.string("feed_forward_proj", "relu")
    parts = projection.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise SpecError(
            "feed_forward_proj",
            f"must be 'gated-{{ACT_FN}}' or '{{ACT_FN}}' (e.g. 'gated-gelu', 'relu'), got "
            f"{_short(projection)}",
        )
    gated = parts[0] == "gated"
    # T5Config.__post_init__: "gated-gelu" runs gelu_new (the tanh formula)
    act = "gelu_new" if projection == "gated-gelu" else parts[-1]
    encoder_layers = f.positive_int("num_layers", 6)
    dropout = f.prob("dropout_rate", 0.1)
    # transformers 5 T5Config.__post_init__: "we tie weights always and force it to be True";
    # the config's tie_word_embeddings only decides whether the decoder output is scaled by
    # d_model**-0.5 (``scale_decoder_outputs``; false for T5 v1.1 / Flan-T5). So Flan-T5's
    # separate lm_head of the checkpoint (published 2.85B for flan-t5-xl) is not a parameter
    # of the transformers 5 model (2.78B).
    scale = f.flag("tie_word_embeddings", True)
    return dict(
        architecture="encoder-decoder",
        num_layers=encoder_layers,
        num_decoder_layers=f.positive_int("num_decoder_layers", encoder_layers),
        hidden_size=d,
        num_heads=a,
        num_kv_heads=a,
        head_dim=f.positive_int("d_kv", 64),
        intermediate_size=f.positive_int("d_ff", 2048),
        mlp_kind="gated" if gated else "gelu",
        hidden_act=act,
        norm_kind="rmsnorm",
        vocab_size=f.positive_int("vocab_size", 32128),
        # relative position buckets set no hard limit; n_positions is the trained length
        # (512) and the default --seq-len
        max_position_embeddings=f.positive_int("n_positions", 512),
        position_kind="none",
        relative_attention_buckets=f.positive_int("relative_attention_num_buckets", 32),
        tie_word_embeddings=True,
        scale_tied_output=scale,
        head="seq2seq-lm",
        hidden_dropout=dropout,
        attention_dropout=dropout,
        embedding_dropout=dropout,
    )


_TRANSLATORS: dict[str, Callable[[_Fields], dict[str, Any]]] = {
    "bert": _bert,
    "clip_vision_model": _clip_vision_model,
    "deepseek_v3": _deepseek_v3,
    "dinov2": _dinov2,
    "siglip_vision_model": _siglip_vision_model,
    "t5": _t5,
    "falcon": _falcon,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "phi": _phi,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "vit": _vit,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_TRANSLATORS))
"""HF ``model_type`` values :func:`model_spec_from_hf` understands."""


def model_spec_from_hf(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Translate a Hugging Face config dict into a ModelSpec.

    Args:
        config: the parsed ``config.json``.
        name: what to call the spec (preset name or path).

    Returns:
        The spec; its parameter count equals ``sum(p.numel())`` of the transformers model
        class named in ``architectures`` (tested per preset on the meta device).

    Raises:
        SpecError: missing ``model_type`` or required shape field, a non-positive size,
            heads that do not divide the width.
        UnsupportedError: a ``model_type`` or option that is not modelled.
    """
    if not isinstance(config, Mapping):
        raise SpecError("model", f"a config must be a mapping, got {_short(config)}")
    model_type = config.get("model_type")
    if not model_type or not isinstance(model_type, str):
        raise SpecError(
            "model_type",
            "required field missing from the config; a Hugging Face config.json names its "
            f"family there (supported: {', '.join(SUPPORTED_MODEL_TYPES)})",
        )
    translator = _TRANSLATORS.get(model_type)
    if translator is None:
        raise UnsupportedError(
            f"model_type {_short(model_type)} is not supported by the analytic engine "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use --engine trace, or pass "
            "the config of a supported family with the same shapes"
        )
    kwargs = translator(_Fields(config, model_type))
    return ModelSpec(name=name, model_type=model_type, **kwargs)
