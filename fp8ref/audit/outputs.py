"""The audited model's inputs and outputs: batches in, logits or embeddings out, and the model-level
metrics computed from them (perplexity, KL, top-1 agreement; embedding cosine, nearest neighbours)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .report import ModelMetrics

__all__ = ["batches", "call_model", "token_ids", "detect_kind", "logits", "embedding", "LmAccumulator",
           "encoder_metrics"]


def batches(inputs: Any) -> list[Any]:
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 1:
            inputs = inputs.unsqueeze(0)
        return [inputs[i:i + 1] for i in range(inputs.shape[0])]
    if isinstance(inputs, dict):
        return [inputs]
    if isinstance(inputs, Iterable):
        out = list(inputs)
        if not out:
            raise ValueError("inputs is empty: give at least one batch")
        for b in out:
            if not isinstance(b, (torch.Tensor, dict)):
                raise TypeError(f"each batch must be a tensor of token ids or a dict of model kwargs, "
                                f"got {type(b).__name__}")
        return out
    raise TypeError(f"inputs must be a tensor [B, T], a dict of model kwargs or a list of those, "
                    f"got {type(inputs).__name__}")


def call_model(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


def token_ids(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, dict):
        return batch.get("input_ids")
    return batch if not batch.is_floating_point() else None


def detect_kind(out: Any) -> str:
    if hasattr(out, "logits"):
        return "causal_lm"
    if hasattr(out, "last_hidden_state"):
        return "encoder"
    if isinstance(out, torch.Tensor) and out.dim() == 3:
        return "causal_lm"
    raise ValueError(f"cannot tell the model kind from its output ({type(out).__name__}); pass kind="
                     "'causal_lm' (output .logits or a [B, T, V] tensor) or 'encoder' (.last_hidden_state)")


def logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def embedding(out: Any, batch: Any) -> torch.Tensor:
    """Mean-pooled (over the attention mask), L2-normalized sentence embeddings, float64."""
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out
    h = h.to(torch.float64)
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if mask is None:
        e = h.mean(dim=1)
    else:
        m = mask.to(torch.float64).unsqueeze(-1)
        e = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
    return F.normalize(e, dim=-1)


class LmAccumulator:
    """Sums over a causal LM's positions: NLL (float and FP8), KL, top-1 agreement, per-token lists."""

    def __init__(self) -> None:
        self.nll_fp = self.nll_q = self.kl = 0.0
        self.kl_max = 0.0
        self.n_pred = self.n_pos = self.agree = 0
        self.n_seq = 0
        self.tok_nll: list[float] = []
        self.tok_kl: list[float] = []
        self.tok_top1: list[int] = []

    def add(self, lf: torch.Tensor, lq: torch.Tensor, ids: torch.Tensor | None) -> None:
        lf, lq = lf.to(torch.float64), lq.to(torch.float64)
        pf, pq = F.log_softmax(lf, dim=-1), F.log_softmax(lq, dim=-1)
        kl = (pf.exp() * (pf - pq)).sum(-1)
        self.kl += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max())) if not math.isnan(float(kl.max())) else math.nan
        self.n_pos += kl.numel()
        same = lf.argmax(-1) == lq.argmax(-1)
        self.agree += int(same.sum())
        self.tok_kl += [round(v, 7) for v in kl.reshape(-1).tolist()]
        self.tok_top1 += same.reshape(-1).int().tolist()
        self.n_seq += lf.shape[0]
        if ids is not None and ids.shape[-1] > 1:
            tgt = ids[:, 1:].unsqueeze(-1)
            self.nll_fp -= float(pf[:, :-1].gather(-1, tgt).sum())
            nq = -pq[:, :-1].gather(-1, tgt)
            self.nll_q += float(nq.sum())
            self.tok_nll += [round(v, 7) for v in nq.reshape(-1).tolist()]
            self.n_pred += tgt.numel()

    def metrics(self) -> ModelMetrics:
        nan = float("nan")

        def ppl(s: float) -> float:
            return math.exp(s / self.n_pred) if self.n_pred else nan

        return ModelMetrics(kind="causal_lm", n_tokens=self.n_pos, n_sequences=self.n_seq,
                            ppl_fp=ppl(self.nll_fp), ppl_fp8=ppl(self.nll_q),
                            kl_mean=self.kl / self.n_pos if self.n_pos else nan, kl_max=self.kl_max,
                            top1_agreement=self.agree / self.n_pos if self.n_pos else nan,
                            token_nll=self.tok_nll, token_kl=self.tok_kl, token_top1=self.tok_top1)


def encoder_metrics(ef: torch.Tensor, eq: torch.Tensor, n_tokens: int) -> ModelMetrics:
    cos = (ef * F.normalize(eq, dim=-1)).sum(-1)
    nn_agree = float("nan")
    if ef.shape[0] > 1:
        def nearest(e):
            sim = e @ e.T
            sim.fill_diagonal_(-math.inf)
            return sim.argmax(-1)
        nn_agree = float((nearest(ef) == nearest(F.normalize(eq, dim=-1))).double().mean())
    return ModelMetrics(kind="encoder", n_tokens=n_tokens, n_sequences=ef.shape[0],
                        embedding_cosine_mean=float(cos.mean()), embedding_cosine_min=float(cos.min()),
                        nn_agreement=nn_agree)
