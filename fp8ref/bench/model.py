"""End-to-end throughput: a real model's decode and prefill tokens/s after ``quantize_model``
against the same model in bf16, in one run (``fp8ref bench --model``).

Two models: ``smollm2`` (SmolLM2-135M-Instruct from the audit extra, ``fp8ref.audit.material``)
and ``llama8b``, a ``LlamaForCausalLM`` built from a ``LlamaConfig`` with random weights (no
download) whose decoder layers have the Llama-3.1-8B widths (hidden 4096, intermediate 14336, 32
heads, 8 KV heads), ``layers`` of them and a small vocabulary (``LLAMA_VOCAB``: the lm_head is left
in bf16 by ``quantize_model``, and the 8B's 128k-row head would time the head, not the layers).

Each figure is paired: the bf16 model and its quantized copy alternate round by round
(``timing.paired``), so both see the same machine. Decode is greedy, one token per step with the
KV cache, from a prompt of ``prompt`` tokens (the cache is cropped back to the prompt before each
timed call); prefill is one forward pass over the prompt without a cache. ``compiled`` adds the same
pairs for ``torch.compile`` of both models.

Where a decode token's time goes (``breakdown``): one decode step of each model with hooks records
every linear layer's input; the layers are then timed alone on those inputs, in rounds paired with
the step (the bf16 ``F.linear`` of each ``nn.Linear``; each ``Fp8Linear`` as called, paired with its
backend's ``linear`` on the prepared weight: the kernel without fp8ref's per-call path). A step's
time minus its layers' is the time a token spends outside the GEMMs (attention, norms, embeddings,
Python of the model).

``dense_fallback="auto"`` quantizes with ``quantize_model(..., dense_fallback="auto")``: each layer
decides per M bucket, at its first call there, whether to run ``F.linear`` on its kept original
weight instead (``fp8ref.select.dense``); the report records the decisions and the kept memory.
The compiled pairs run FP8 throughout (the custom op has no dense path).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..nn import Fp8Linear
from ..select.keys import m_bucket
from ..surgery import QuantizeSummary, quantize_model
from .load import mark, unreliable_reason
from .timing import paired

__all__ = ["MODELS", "LLAMA_VOCAB", "build_model", "bench_model", "bench_models", "format_model_report"]

#: The models ``fp8ref bench --model`` takes.
MODELS = ("smollm2", "llama8b")
#: Vocabulary of the random Llama-shaped model (see the module docstring).
LLAMA_VOCAB = 2048
#: dynamo's recompile limit while the compiled pairs run (see ``bench_model``).
RECOMPILE_LIMIT = 64


def build_model(name: str, layers: int = 1) -> nn.Module:
    """The bf16 model ``name`` (``MODELS``) in eval mode; ``layers`` decoder layers for ``llama8b``."""
    if name == "smollm2":
        from ..audit.material import load_model

        return load_model("smollm2", torch.bfloat16)[0].eval()
    if name != "llama8b":
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise RuntimeError(f"the llama8b model needs transformers ({exc}); pip install 'fp8ref[audit]'") from None
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=layers, vocab_size=LLAMA_VOCAB, max_position_embeddings=4096)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: never a float32 copy of the weights
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def _decoder(model: nn.Module, prompt: torch.Tensor, tokens: int) -> Callable[[], torch.Tensor]:
    """A call that decodes ``tokens`` greedy tokens after ``prompt`` (prefilled once, here)."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
    cache, first = out.past_key_values, out.logits[:, -1:].argmax(-1)
    n = prompt.shape[1]

    def run() -> torch.Tensor:
        extra = cache.get_seq_length() - n
        if extra:
            cache.crop(-extra)  # transformers 5: a negative count removes that many positions
        tok = first
        with torch.no_grad():
            for _ in range(tokens):
                tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return tok

    return run


def _prefiller(model: nn.Module, prompt: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.no_grad():
            return model(prompt, use_cache=False).logits

    return run


def _linear_inputs(model: nn.Module, step: Callable[[], Any]) -> list[tuple[nn.Module, torch.Tensor]]:
    """Every linear layer of ``model`` with the input it received in one call of ``step``."""
    seen: list[tuple[nn.Module, torch.Tensor]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0].detach().clone())))
             for m in model.modules() if isinstance(m, (nn.Linear, Fp8Linear))]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return seen


def _kernel_call(mod: Fp8Linear, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The backend of the plan ``mod`` runs on ``x``, called on the plan's prepared weight: the kernel alone
    (the plan's bound call where the backend binds one, ``Backend.bind_linear``, else its ``linear``)."""
    p = mod.plan(x)
    if p is None:
        raise ValueError(f"{mod!r} runs {tuple(x.shape)} through fp8ref.linear (weight_check='content'?): no plan "
                         "to time its kernel alone")
    x2, bias = x.reshape(-1, x.shape[-1]), mod.bias
    if p.fast is not None and p.fast(x, bias) is not None:  # the plan's bound call: one call into the kernel
        return lambda: p.fast(x, bias)
    return lambda: p.backend.linear(x2, p.prepared, bias, p.out_dtype, p.scheme)


def _runs_dense(mod: Fp8Linear, x: torch.Tensor) -> bool:
    """Whether ``mod``'s call on ``x`` runs its dense fallback (decided dense for x's bucket and dtype)."""
    b = m_bucket(x.numel() // max(x.shape[-1], 1))
    return any(c.dense and dt == x.dtype and c.bucket == b for dt, c in mod.dense_decisions())


def _breakdown(model: nn.Module, step: Callable[[], Any], tokens: int, repeat: int, budget_s: float) -> dict:
    """Seconds per decode token: the step, its linear layers (and their kernels alone), the rest."""
    with torch.no_grad():
        calls = _linear_inputs(model, step)
        per_token = len(calls) // tokens
        calls = calls[:per_token]  # the first token's layers: one decode step
        layers = [(lambda m=m, x=x: m(x)) for m, x in calls]
        # Paired rounds (as the ratios are): a step and its layers alone, back to back.
        p = paired(step, lambda: [f() for f in layers], repeat=repeat, budget_s=budget_s, min_sample_s=0.0)
        step_s, layers_s = p.base.median_s / tokens, p.timing.median_s
        out = {"step_s": step_s, "linear_layers": len(calls), "linear_s": layers_s,
               "outside_linear_s": step_s - layers_s}
        fp8 = [(m, x) for m, x in calls if isinstance(m, Fp8Linear) and not _runs_dense(m, x)]
        dense = sum(isinstance(m, Fp8Linear) and _runs_dense(m, x) for m, x in calls)
        if dense:
            out["dense_layers"] = dense
        if fp8:
            kernels = [_kernel_call(m, x) for m, x in fp8]
            p = paired(lambda: [m(x) for m, x in fp8], lambda: [k() for k in kernels], repeat=repeat,
                       budget_s=budget_s, min_sample_s=0.0)
            out["fp8_layers"] = len(fp8)
            out["fp8_layers_s"], out["fp8_kernels_s"] = p.base.median_s, p.timing.median_s
    return out


def _pair(base: Callable[[], Any], fn: Callable[[], Any], units: int, repeat: int, budget_s: float) -> dict:
    p = paired(base, fn, repeat=repeat, budget_s=budget_s, min_sample_s=0.0)
    return {"bf16_tokens_per_s": units / p.base.median_s, "fp8_tokens_per_s": units / p.timing.median_s,
            "ratio": p.ratio, "rounds": p.rounds}


def _dense_report(summary: QuantizeSummary) -> dict:
    """The dense fallback's state after a run: kept layers and bytes, and the decisions made."""
    return {"mode": summary.dense_fallback, "layers": summary.dense_layers, "extra_bytes": summary.dense_bytes,
            "decisions": summary.dense_decisions()}


def bench_model(name: str, *, layers: int = 1, prompt: int = 128, tokens: int = 16, compiled: bool = False,
                repeat: int = 5, budget_s: float = 30.0, dense_fallback: str | None = None,
                log: Callable[[str], None] = lambda s: None) -> dict:
    """Decode and prefill tokens/s of ``name`` in bf16 and after ``quantize_model``, paired.

    Returns a dict with ``model``, ``linear_layers`` (quantized / all), ``eager`` (and ``compiled``)
    each holding ``decode`` and ``prefill`` (``bf16_tokens_per_s``, ``fp8_tokens_per_s``,
    ``ratio`` = fp8 tokens/s over bf16, the median of per-round ratios; ``compiled`` also
    ``compile_seconds``, its untimed warm-up decode calls), and ``breakdown``
    (``bf16``, ``fp8``: seconds per decode token in the step, its linear layers, outside them).
    With ``dense_fallback="auto"`` (``quantize_model``'s argument) also ``dense_fallback``: the
    kept layers and bytes and every decision made during the run (``QuantizeSummary.dense_decisions``).
    """
    t0 = time.perf_counter()
    base = build_model(name, layers)
    fp8 = copy.deepcopy(base)
    summary = quantize_model(fp8, dense_fallback=dense_fallback)
    log(f"  {name}: {summary}")
    vocab = base.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, prompt), generator=g)
    res: dict[str, Any] = {"model": name, "layers": layers if name == "llama8b" else None, "prompt": prompt,
                           "tokens": tokens, "quantized_layers": summary.layers,
                           "skipped_layers": summary.skipped}
    variants = [("eager", base, fp8)]
    if compiled:
        # dynamic=True: decoding grows the KV cache by one position per step, and with static
        # shapes dynamo recompiles per length until its recompile limit (the timing then measures
        # compilation, and the model falls back to eager).
        variants.append(("compiled", torch.compile(base, dynamic=True), torch.compile(fp8, dynamic=True)))
    for mode, b, f in variants:
        t1 = time.perf_counter()
        # The two compiled models run the same forward code, which dynamo caches per code object:
        # their entries (module types, prefill and decode shapes) together pass its default
        # recompile limit, after which it falls back to eager. The limit is raised for the run.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            db, df = _decoder(b, ids, tokens), _decoder(f, ids, tokens)
            warm_s = None
            if mode == "compiled":
                # Compile outside the timing: the first decode call runs on the prefilled cache and
                # the later ones on a cropped one, whose tensors keep the longer buffer's strides,
                # and dynamo compiles for each (a 30-layer model takes a minute per graph here).
                # Two calls of each model compile every graph the timed calls run.
                t2 = time.perf_counter()
                for _ in range(2):
                    db(), df()
                warm_s = time.perf_counter() - t2
            res[mode] = {"decode": _pair(db, df, tokens, repeat, budget_s),
                         "prefill": _pair(_prefiller(b, ids), _prefiller(f, ids), prompt, repeat, budget_s)}
        res[mode]["seconds"] = time.perf_counter() - t1
        if warm_s is not None:
            res[mode]["compile_seconds"] = warm_s
        log(f"  {name} {mode}: decode {res[mode]['decode']['ratio']:.2f}x bf16, prefill "
            f"{res[mode]['prefill']['ratio']:.2f}x ({res[mode]['seconds']:.0f} s)")
        if mode == "eager":
            res["breakdown"] = {"bf16": _breakdown(b, db, tokens, repeat, budget_s / 2),
                                "fp8": _breakdown(f, df, tokens, repeat, budget_s / 2)}
    if dense_fallback is not None:
        res["dense_fallback"] = _dense_report(summary)
        log(f"  {name}: {summary}")
    res["seconds"] = time.perf_counter() - t0
    return res


def bench_models(names: Sequence[str], **kw) -> list[dict]:
    """``bench_model`` for each of ``names``."""
    return [bench_model(n, **kw) for n in names]


def format_model_report(res: dict) -> str:
    """The table ``fp8ref bench --model`` prints: tokens/s and the fp8/bf16 ratio per model, mode and
    phase, then where a decode token's time goes.

    Examples
    --------
    >>> from fp8ref.bench.model import format_model_report
    >>> row = {"model": "m", "quantized_layers": 2, "eager": {p: {"bf16_tokens_per_s": 10.0, "fp8_tokens_per_s": 15.0,
    ...        "ratio": 1.5, "rounds": 3} for p in ("decode", "prefill")}}
    >>> format_model_report({"meta": {"cpu_model": "cpu"}, "models": [row]}).splitlines()[2].split()[:3]
    ['m', 'eager', 'decode']

    With a load average above the thread count the ratios are printed marked ``?``, after a line
    saying why (``fp8ref.bench.load``).
    """
    meta = res.get("meta", {})
    load = meta.get("loadavg_start")
    why, q = unreliable_reason(meta), mark(meta)
    lines = [f"end-to-end tokens/s after quantize_model, paired with bf16 [on {meta.get('cpu_model', '?')}, "
             f"{meta.get('torch_threads', '?')} threads, load average {'?' if not load else f'{load[0]:.1f}'} on "
             f"{meta.get('cpu_count', '?')} CPUs]"]
    if why:
        lines.append(f"UNRELIABLE ({why}): ratios marked ?")
    lines.append(f"{'model':8} {'mode':8} {'phase':8} {'bf16 t/s':>9} {'fp8 t/s':>9} {'fp8/bf16':>7} {'rounds':>7}")
    for r in res["models"]:
        for mode in ("eager", "compiled"):
            for phase in ("decode", "prefill"):
                f = r.get(mode, {}).get(phase)
                if f:
                    lines.append(f"{r['model']:8} {mode:8} {phase:8} {f['bf16_tokens_per_s']:9.1f} "
                                 f"{f['fp8_tokens_per_s']:9.1f} {f['ratio']:6.2f}x{q or ' '}{f['rounds']:6d}")
    for r in res["models"]:
        bd = r.get("breakdown")
        if not bd:
            continue
        lines.append(f"{r['model']}: a decode token's time (ms) -- step = linear layers + outside them")
        for k in ("bf16", "fp8"):
            b = bd[k]
            extra = ""
            if "fp8_kernels_s" in b:
                extra = (f"; of the {b['fp8_layers']} Fp8Linear calls {1e3 * b['fp8_layers_s']:.2f} ms, their "
                         f"backends' kernels alone {1e3 * b['fp8_kernels_s']:.2f} ms")
            if b.get("dense_layers"):
                extra += f"; {b['dense_layers']} Fp8Linear calls ran dense"
            lines.append(f"  {k:5} step {1e3 * b['step_s']:.2f}, {b['linear_layers']} linear layers "
                         f"{1e3 * b['linear_s']:.2f}, outside them {1e3 * b['outside_linear_s']:.2f}{extra}")
    for r in res["models"]:
        if r.get("dense_fallback"):
            lines.append(format_dense(r["model"], r["dense_fallback"]))
    return "\n".join(lines)


def format_dense(model: str, d: dict) -> str:
    """The dense fallback's line of the report: kept layers and memory, then each (shape, dtype,
    bucket) decided, with FP8's speed over dense's (each shape's first timed layer's).

    Examples
    --------
    >>> from fp8ref.bench.model import format_dense
    >>> dec = [{"N": 8, "K": 4, "dtype": "bfloat16", "bucket": 128, "dense": True, "ratio": 0.5},
    ...        {"N": 8, "K": 4, "dtype": "bfloat16", "bucket": 1, "dense": False, "ratio": 2.0}]
    >>> print(format_dense("m", {"mode": "auto", "layers": 2, "extra_bytes": 2**20, "decisions": dec}))
    m: dense fallback 'auto': 2 layers keep their original weight (+1.0 MiB); by NxK dtype and M bucket:
      8x4 bfloat16 M<=1: fp8 (fp8/dense speed 2.00); 8x4 bfloat16 M<=128: dense (fp8/dense speed 0.50)
    """
    seen: dict[tuple, dict] = {}
    for x in d["decisions"]:
        seen.setdefault((x["N"], x["K"], x["dtype"], x["bucket"]), x)
    parts = []
    for (n, k, dt, b), x in sorted(seen.items()):
        why = "forced" if x["ratio"] is None else f"fp8/dense speed {x['ratio']:.2f}"
        parts.append(f"{n}x{k} {dt} M<={b}: {'dense' if x['dense'] else 'fp8'} ({why})")
    return (f"{model}: dense fallback {d['mode']!r}: {d['layers']} layers keep their original weight "
            f"(+{d['extra_bytes'] / 2**20:.1f} MiB); by NxK dtype and M bucket:\n  "
            + ("; ".join(parts) or "none decided"))
