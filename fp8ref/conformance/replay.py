"""Replay a counterexample: the exact tensors of a failing example, the spec's result and its bound.

A report keeps each failure's problem machine-readable (``ContractResult.problem``, printed as the
``replay:`` line and kept in ``--json``). ``replay`` rebuilds the problem, its input tensors (bit
for bit what the backend was given), the reference's result and the elementwise bound the contract
compared with; ``Replay.write_script`` writes them into a standalone Python file that needs only
torch, to hand to whoever owns the kernel. Imports flow down: the spec and ``problems``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from ..check.problems import GemmProblem, LinearProblem, QuantizeProblem, problem_from_dict, problem_to_dict
from ..spec import quant
from ..spec.bounds import Accumulation, conforming_quantization_error_bound, gemm_error_bound, linear_error_bound
from ..spec.gemm import scaled_mm_exact

__all__ = ["Replay", "replay"]


@dataclass
class Replay:
    """A counterexample rebuilt.

    Attributes
    ----------
    problem : QuantizeProblem, GemmProblem or LinearProblem
    inputs : dict of str to Tensor
        What the backend was called with: ``x`` (and a static ``scale``) for quantize; ``a_codes``,
        ``a_scale``, ``b_codes``, ``b_scale`` (and ``bias``) for scaled_mm; ``x``, ``w`` (and ``bias``,
        a static activation ``scale``) for linear.
    reference : Tensor
        What the output is compared with (float64): the unquantized ``x`` for quantize (the codes
        times the scale must lie within ``bound`` of it), the reference's result for scaled_mm, the
        float64 linear of the unquantized inputs for linear.
    bound : Tensor
        The elementwise bound of the contract's bounded check (float64), for the declaration given.
    spec : dict of str to Tensor
        The spec's own quantization (``codes``, ``scale``; for linear ``x_codes``, ``x_scale``,
        ``w_codes``, ``w_scale``), for comparison.
    """

    problem: object
    inputs: dict[str, torch.Tensor]
    reference: torch.Tensor
    bound: torch.Tensor
    spec: dict[str, torch.Tensor] = field(default_factory=dict)

    def check(self, value: torch.Tensor) -> tuple[bool, str]:
        """(within the bound everywhere, a sentence locating the worst element)."""
        err = (value.to(torch.float64) - self.reference).abs()
        ratio = torch.where(self.bound > 0, err / self.bound, torch.where(err == 0, 0.0, torch.inf))
        ratio = torch.where(torch.isnan(err), torch.inf, ratio)
        if ratio.numel() == 0:
            return True, "empty"
        idx = tuple(int(i) for i in torch.unravel_index(torch.argmax(ratio), ratio.shape))
        worst = float(ratio[idx])
        return worst <= 1, (f"worst at {idx}: got {float(value[idx])!r}, reference {float(self.reference[idx])!r}, "
                            f"bound {float(self.bound[idx]):.6g}, ratio {worst:.3g}")

    def write_script(self, path: str) -> None:
        """Write a standalone script (torch only, no fp8ref) holding the exact tensors, the reference
        and the bound, with a ``check(y)`` to call on the kernel's output."""
        lines = ['"""Standalone replay of an fp8ref counterexample (needs torch only, not fp8ref).',
                 "",
                 f"Problem: {self.problem!r}",
                 f"Machine-readable: {json.dumps(problem_to_dict(self.problem))}",
                 "",
                 "INPUTS holds the exact tensors the backend was called with; call your kernel on them and pass",
                 "its output to check(): |y - REFERENCE| <= BOUND must hold elementwise (SPEC: the spec's own",
                 "quantization).",
                 '"""',
                 "",
                 "import torch",
                 "",
                 "",
                 "def _t(hexbytes, dtype, shape):",
                 "    raw = torch.frombuffer(bytearray.fromhex(hexbytes), dtype=torch.uint8)",
                 "    return raw.view(dtype).reshape(shape).clone()",
                 "",
                 ""]
        for name, group in (("INPUTS", self.inputs), ("SPEC", self.spec)):
            lines.append(f"{name} = {{")
            lines += [f"    {k!r}: {_tensor_code(v)}," for k, v in group.items()]
            lines.append("}")
        lines += [f"REFERENCE = {_tensor_code(self.reference)}", f"BOUND = {_tensor_code(self.bound)}", "", "",
                  "def check(y):",
                  '    """True when y is within BOUND of REFERENCE everywhere; prints the worst element."""',
                  "    err = (y.to(torch.float64) - REFERENCE).abs()",
                  "    ratio = torch.where(BOUND > 0, err / BOUND, torch.where(err == 0, 0.0, torch.inf))",
                  "    ratio = torch.where(torch.isnan(err), torch.inf, ratio)",
                  "    idx = tuple(int(i) for i in torch.unravel_index(torch.argmax(ratio), ratio.shape))",
                  "    print(f'worst at {idx}: got {float(y[idx])!r}, reference {float(REFERENCE[idx])!r}, '",
                  "          f'bound {float(BOUND[idx]):.6g}, ratio {float(ratio[idx]):.3g}')",
                  "    return bool((ratio <= 1).all())",
                  "",
                  "",
                  'if __name__ == "__main__":',
                  "    for k, v in INPUTS.items():",
                  "        print(k, tuple(v.shape), v.dtype)",
                  "    print('reference', tuple(REFERENCE.shape), '; call check(y) on your kernel\\'s output')",
                  ""]
        with open(path, "w") as f:
            f.write("\n".join(lines))


def _tensor_code(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return f"_t({bytes(raw.tolist()).hex()!r}, {t.dtype}, {tuple(t.shape)})"


def replay(problem, *, accumulation: Accumulation = Accumulation.FP32, output_roundings: int = 1) -> Replay:
    """Rebuild a counterexample's exact tensors, the reference's result and the contract's bound.

    Parameters
    ----------
    problem : dict, str or problem
        ``ContractResult.problem`` (a dict), its JSON text (the report's ``replay:`` line), or a
        ``QuantizeProblem``/``GemmProblem``/``LinearProblem``.
    accumulation, output_roundings
        The backend's declaration, for the GEMM and linear bounds (default: fp32, one rounding).

    Returns
    -------
    Replay

    Examples
    --------
    >>> import torch
    >>> from fp8ref import QuantScheme
    >>> from fp8ref.conformance import replay
    >>> from fp8ref.conformance.problems import QuantizeProblem, TensorSpec, problem_to_dict
    >>> p = QuantizeProblem(2, 16, torch.bfloat16, QuantScheme(), TensorSpec("normal", 0, 3))
    >>> r = replay(problem_to_dict(p))
    >>> r.inputs["x"].shape, r.check(r.spec["codes"].float() * r.spec["scale"].float())[0]
    (torch.Size([2, 16]), True)
    """
    if isinstance(problem, str):
        try:
            problem = json.loads(problem)
        except json.JSONDecodeError as exc:
            raise ValueError(f"problem: not the JSON of a counterexample ({exc})") from None
    if isinstance(problem, dict):
        problem = problem_from_dict(problem)
    if isinstance(problem, QuantizeProblem):
        x = problem.build()
        scale = problem.scale(x)
        ref = quant.quantize(x, problem.scheme, scale)
        inputs = {"x": x} if scale is None else {"x": x, "scale": scale}
        return Replay(problem, inputs, x.to(torch.float64), conforming_quantization_error_bound(x, ref),
                      {"codes": ref.data, "scale": ref.scale})
    if isinstance(problem, GemmProblem):
        a, b, bias = problem.build()
        y_ref, _ = scaled_mm_exact(a, b, bias)
        bound = gemm_error_bound(a, b, bias, out_dtype=problem.out_dtype, accumulation=accumulation,
                                 output_roundings=output_roundings, y_ref=y_ref)
        inputs = {"a_codes": a.data, "a_scale": a.scale, "b_codes": b.data, "b_scale": b.scale}
        if bias is not None:
            inputs["bias"] = bias
        return Replay(problem, inputs, y_ref, bound)
    if isinstance(problem, LinearProblem):
        x, w, bias = problem.build()
        scale = problem.act_scale(x)
        qx, qw = quant.quantize(x, problem.recipe.activation, scale), quant.quantize(w, problem.recipe.weight)
        y_true = x.to(torch.float64) @ w.to(torch.float64).T
        if bias is not None:
            y_true = y_true + bias.to(torch.float64)
        bound = linear_error_bound(x, w, qx, qw, bias, out_dtype=problem.out_dtype, accumulation=accumulation,
                                   output_roundings=output_roundings)
        inputs = {"x": x, "w": w}
        if bias is not None:
            inputs["bias"] = bias
        if scale is not None:
            inputs["scale"] = scale
        return Replay(problem, inputs, y_true, bound,
                      {"x_codes": qx.data, "x_scale": qx.scale, "w_codes": qw.data, "w_scale": qw.scale})
    raise TypeError(f"problem: expected a serialized or built conformance problem, got {type(problem).__name__}")
