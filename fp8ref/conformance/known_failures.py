"""Ledger of known failures of third-party code that fp8ref's backends run on (product data: the
CLI reads it; ``properties/known_failures.py`` re-exports it for the property tests).

Each entry names the backend, what goes wrong, the upstream link and why fp8ref is (or is not)
affected. Tests that reproduce an entry are marked ``xfail(strict=True)`` through ``xfail(id)``,
so an upstream fix makes them XPASS -> fail, which forces the entry's removal. The conformance
suite reads ``KNOWN_FAILURES`` to report these next to its own results.

Fields: ``id`` (stable key), ``backend`` (registry name, or a peer of ``fp8ref.peers``), ``applies``
(when it bites), ``what`` (the failing property), ``link`` (upstream issue/PR, or None if none was
found), ``reason`` (the cause, and the workaround fp8ref uses), ``test`` (the test that reproduces it).
Entries for peers also name the conformance ``property`` (contract) they turn into a strict xfail in
``fp8ref certify`` and its ``upstream`` link; their ``test`` is a standalone reproduction in
``tests/findings/`` (docs/findings.md).
"""

from __future__ import annotations

__all__ = ["KNOWN_FAILURES", "known_failure", "xfail"]

KNOWN_FAILURES: list[dict] = [
    {
        "id": "triton-interp-fp8-cast",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9)",
        "what": "x.to(tl.float8e4nv) on fp32 is not round-to-nearest-even: ties round away from zero "
                "and carries out of the mantissa are lost (about 1% of uniform inputs in [-448, 448])",
        "link": "https://github.com/triton-lang/triton/issues/8322",
        "reason": "the interpreter's _convert_float downcast (fix proposed in triton PR #11897); the triton "
                  "backend rounds with integer ops on the fp32 bits instead, so its codes are exact",
        "test": "tests/test_kernel_triton_interpreter.py::test_interpreter_fp8_cast_is_rne",
    },
    {
        "id": "triton-interp-bf16-store",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9)",
        "what": "fp32 -> tl.bfloat16 conversion truncates the low 16 bits instead of rounding to nearest even",
        "link": None,
        "reason": "no upstream report found (related: triton PR #10945 on bf16 arithmetic in the interpreter); "
                  "the triton backend stores its GEMM result as fp32 and torch rounds it to out_dtype",
        "test": "tests/test_kernel_triton_interpreter.py::test_interpreter_bf16_store_is_rne",
    },
    {
        "id": "torch-cpu-scaled-mm-fnuz",
        "backend": "torch",
        "applies": "torch 2.13.0+cpu, on some CPUs: seen raising at every shape on an Intel Xeon Sapphire Rapids "
                   "(amx) and at M = N = 1 on one AMD EPYC Zen 4 (avx512_bf16, family 25, 2026-12-01); seen "
                   "running everywhere on another Zen 4 (family 25 model 17, 2026-12-03), a Zen 5 (family 26), "
                   "an Ice Lake Xeon (avx512) and a Zen 3 (avx2). Not a function of the CPU design",
        # Observations, one per machine seen (fp8ref._machine.cpu_signature; None: not recorded), never a
        # prediction: two family-25 EPYCs with avx512_bf16 (Zen 4) disagreed at M = N = 1, and on the
        # second one torch 2.13 took no oneDNN path at all (ONEDNN_VERBOSE printed nothing), so what
        # decides it is torch's dispatch on this machine, which fp8ref cannot see. A test that asserted
        # the record of the design made main red on the second Zen 4; the test now asserts what holds on
        # every machine (the error, where raised, is this entry's; a result, where computed, is within
        # the bound) and warns where a machine disagrees with its design's earlier records.
        "cpus": [
            {"kind": "amx", "vendor": "GenuineIntel", "family": 6, "model": 143, "raises": "every shape",
             "seen": "2026-12-01"},
            {"kind": "avx512_bf16", "vendor": "AuthenticAMD", "family": 25, "model": None, "raises": "M = N = 1",
             "seen": "2026-12-01"},
            {"kind": "avx512_bf16", "vendor": "AuthenticAMD", "family": 25, "model": 17, "raises": "never",
             "seen": "2026-12-03"},
            {"kind": "avx512_bf16", "vendor": "AuthenticAMD", "family": 26, "model": 2, "raises": "never",
             "seen": "2026-12-01"},
            {"kind": "avx512", "vendor": "GenuineIntel", "family": 6, "model": 106, "raises": "never",
             "seen": "2026-12-01"},
            {"kind": "avx2", "vendor": "AuthenticAMD", "family": 25, "model": 1, "raises": "never",
             "seen": "2026-12-01"},
        ],
        "what": "torch._scaled_mm raises RuntimeError 'itensor_view_from_dense expects float/bfloat16/half/int8/fp8 "
                "tensor inputFloat8_e4m3fnuz' for E4M3FNUZ operands (E4M3FN and E5M2 work)",
        "link": None,
        "reason": "no upstream report found (searched pytorch issues for itensor_view_from_dense and e4m3fnuz "
                  "_scaled_mm CPU); the torch and torch-fast backends run a trial call per (device, operand "
                  "class) and decline with torch's message, so fp8ref never crashes on it",
        "test": "tests/test_torch_trial.py::test_upstream_fnuz_behaviour_on_this_cpu",
    },
    {
        "id": "triton-interp-bf16-arith",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9)",
        "what": "+ - * / on two bf16 tensors operate on their uint16 bit patterns (c = acc.to(bf16); c += bias "
                "gives ~1e38)",
        "link": "https://github.com/triton-lang/triton/issues/10919",
        "reason": "the interpreter stores bf16 as uint16 and binary_op runs numpy on the storage (fix PR #10945 closed "
                  "unmerged); fp8ref's triton backend does no bf16 arithmetic, and third-party kernels are certified "
                  "under fp8ref.peers.triton_interpreter.correct_downcasts()",
        "test": "tests/test_peers_triton_interpreter.py::test_unpatched_bf16_arithmetic_still_wrong",
    },
    {
        "id": "triton-interp-bf16-subnormal-upcast",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9), bf16 inputs below 2**-126",
        "what": "bf16 -> fp32 of a subnormal is renormalized for an exponent range fp32 does not have and its "
                "exponent clamped at 0: 3 * 2**-130 -> 2**-127, 2**-127 -> 0",
        "link": None,
        "reason": "no upstream report found (searched triton-lang/triton issues for interpreter bf16/fp32 "
                  "conversion and subnormals); no ci example reaches it: seen on sglang-static-quant with a bf16 "
                  "tensor of amax 2**-122; "
                  "fp8ref.peers.triton_interpreter.correct_downcasts() widens bf16 exactly",
        "test": "tests/test_peers_triton_interpreter.py::test_unpatched_bf16_subnormal_upcast_still_wrong",
    },
    {
        "id": "triton-interp-fp8-upcast",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9)",
        "what": "fp8 -> fp16/fp32 decodes NaN and Inf codes as finite numbers (E4M3FN 0x7F -> 480, E5M2 0x7C -> 65536, "
                "E4M3FNUZ 0x80 -> -0), so a NaN code vanishes inside tl.dot",
        "link": None,
        "reason": "no upstream report found for the interpreter (the same class on GPUs: triton PR #11784, "
                  "intel-xpu-backend-for-triton#7771); _convert_float maps the all-ones exponent like any other; "
                  "fp8ref.peers.triton_interpreter.correct_downcasts() decodes through ml_dtypes",
        "test": "tests/test_peers_triton_interpreter.py::test_unpatched_fp8_upcast_still_loses_nan",
    },
    {
        "id": "triton-interp-scalar-mask",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9)",
        "what": "a mask combining a block condition with a scalar comparison ((o < n) & (row < rows)) is an int32 "
                "array: tl.load and tl.store raise ValueError('mask has unsupported dtype')",
        "link": None,
        "reason": "no upstream report found (searched triton-lang/triton issues for the message and for interpreter "
                  "masks with a scalar condition); the interpreter's binary_op labels a comparison with its operands' "
                  "dtype instead of int1 and splat converts the data to that dtype; "
                  "fp8ref.peers.triton_interpreter.correct_downcasts() labels comparisons int1 (LMDeploy's quant_fp8 "
                  "needs it)",
        "test": "tests/test_peers_triton_interpreter.py::test_unpatched_scalar_condition_in_a_block_mask_still_raises",
    },
    {
        "id": "triton-interp-bf16-dot",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9)",
        "what": "tl.dot on bfloat16 operands multiplies the uint16 bit patterns (results ~1e10)",
        "link": "https://github.com/triton-lang/triton/issues/11584",
        "reason": "the interpreter stores bf16 as uint16 and create_dot converts only 8-bit floats; the triton "
                  "backend only calls tl.dot on FP8 operands, which the interpreter converts correctly",
        "test": "tests/test_kernel_triton_interpreter.py::test_interpreter_bf16_dot",
    },
]



def _peer_entries(id: str, peer: str, contracts: tuple[str, ...], *, applies: str, what: str, link: str | None,
                  reason: str, test: str) -> list[dict]:
    """One entry per contract a peer's defect fails in ``fp8ref certify`` (ids ``id:contract``), or one
    entry without a contract for a defect the certificate does not turn into a failure."""
    base = {"backend": peer, "applies": applies, "what": what, "link": link, "upstream": link or "",
            "reason": reason, "test": test}
    if not contracts:
        return [dict(base, id=id)]
    return [dict(base, id=f"{id}:{c}", property=c) for c in contracts]


_F = "tests/findings/"
KNOWN_FAILURES += [
    *_peer_entries(
        "torchao-zero-block-nan", "torchao-float8", ("quantize.codes", "quantize.scale", "quantize.sign_symmetry"),
        applies="torchao 0.18.0, Float8Tensor.from_hp with no activation_value_lb (the default)",
        what="an all-zero block gets scale 0 and NaN codes (0/0)",
        link="https://github.com/pytorch/ao/issues/4713",
        reason="_choose_scale_float8 has no amax floor by default; fix PRs #4714 and #4762 are open",
        test=_F + "test_torchao_float8.py::test_all_zero_row_quantizes_to_zero_codes"),
    *_peer_entries(
        "torchao-row-k1-crash", "torchao-float8",
        ("quantize.exact_on_pow2_scale", "quantize.lossless_on_grid", "quantize.deterministic"),
        applies="torchao 0.18.0, per-row scaling of a [M, 1] tensor",
        what="RuntimeError: shape '[M, 1]' is invalid (block [1, 1] reduces over no dimension)",
        link=None, reason="no upstream report found",
        test=_F + "test_torchao_float8.py::test_per_row_scaling_of_a_single_column"),
    *_peer_entries(
        "torchao-e8m0-nearest", "torchao-float8", (),
        applies="torchao 0.18.0, scale_dtype=torch.float8_e8m0fnu",
        what="E8M0 scales rounded to the nearest power of two: the block maximum is clipped by up to 29 %",
        link=None, reason="no upstream report found (jax-ml/ml_dtypes#298 discusses E8M0 rounding modes); the "
                          "certificate's quantize.scale failure is shrunk to the zero-block defect first",
        test=_F + "test_torchao_float8.py::test_e8m0_scale_never_clips_the_block_maximum"),
    *_peer_entries(
        "compressed-tensors-bf16-double-rounding", "compressed-tensors-fp8", ("quantize.codes",),
        applies="compressed-tensors 0.20.0, bf16 (or fp16) input",
        what="x / scale is rounded to bf16 before E4M3: two roundings, up to 1.06x the one-rounding bound",
        link=None, reason="no upstream report found; quantize() divides in x's dtype",
        test=_F + "test_compressed_tensors_fp8.py::test_bf16_input_is_rounded_once"),
    *_peer_entries(
        "quark-fp8-low-precision-division", "quark-fp8", ("quantize.codes",),
        applies="amd-quark 0.13, bf16 or fp16 input",
        what="x / scale is computed in x's dtype (bf16/fp16) before the FP8 cast: two roundings",
        link=None, reason="no upstream report found (searched for Quark FP8 real_quantize scale dtype issues); "
                          "real_quantize_fp8_per_{tensor,channel}_with_scale divide in the input's dtype",
        test=_F + "test_quark_fp8.py::test_bf16_input_is_rounded_once"),
    *_peer_entries(
        "quark-fp8-channel-scale-in-input-dtype", "quark-fp8",
        ("quantize.exact_on_pow2_scale", "quantize.scale_equivariance", "quantize.sign_symmetry"),
        applies="amd-quark 0.13, per-channel FP8, fp16 input",
        what="the fp32 channel scale is cast to fp16 before the division: scales below fp16's range become 0 "
             "(x / 0: NaN and saturated codes), subnormal ones lose bits",
        link=None, reason="no upstream report found; real_quantize_fp8_per_channel_with_scale does "
                          "scale.to(inputs.dtype)",
        test=_F + "test_quark_fp8.py::test_fp16_small_channel_scale_keeps_its_codes"),
    *_peer_entries(
        "flax-fp8-ops-fp16-scale-underflow", "flax-fp8-ops", ("quantize.sign_symmetry",),
        applies="flax 0.12.7 (linen fp8_ops), fp16 layers, tensors with amax below 448 x 2**-25",
        what="quantize casts the fp32 scale to fp16, where a scale below 2**-25 is 0: x / 0 gives saturated "
             "and NaN codes",
        link=None, reason="no upstream report found; quantize() does scale.astype(compute_dtype)",
        test=_F + "test_flax_fp8_ops.py::test_fp16_small_tensor_keeps_finite_codes"),
    *_peer_entries(
        "flax-fp8-ops-tiny-amax-scale", "flax-fp8-ops", ("quantize.scale",),
        applies="flax 0.12.7 (linen fp8_ops), a normal amax below 448 / FLT_MAX (or whose 1 / m is subnormal)",
        what="compute_scale returns 1 / (448 / amax): 448 / amax overflows to Inf and the scale is 0 (NaN "
             "codes); a subnormal 1 / m is flushed to 0 by XLA:CPU",
        link=None, reason="no upstream report found; with the reciprocal form declared (reciprocal_scale) the "
                          "earlier counterexample, a subnormal amax, matches the spec; the ci sweep reaches a "
                          "normal amax of about 2**-120 (scale 0 for 3.3e-39)",
        test=_F + "test_flax_fp8_ops.py::test_tiny_input_gets_a_scale_from_its_amax"),
    *_peer_entries(
        "tinygrad-division-subnormal-divisor", "tinygrad-fp8", ("quantize.codes", "quantize.sign_symmetry"),
        applies="tinygrad 0.14.0 (PYTHON device), a subnormal scale (subnormal scales kept, no amax floor)",
        what="x / s is lowered to x * reciprocal(s), which overflows for a subnormal s: NaN codes",
        link=None, reason="no upstream report found (searched tinygrad issues for division reciprocal subnormal)",
        test=_F + "test_tinygrad_fp8.py::test_division_by_a_subnormal_scale"),
    *_peer_entries(
        "flax-fp8-ops-bf16-double-rounding", "flax-fp8-ops", ("quantize.codes",),
        applies="flax 0.12.7 (linen fp8_ops), bf16 or fp16 layers",
        what="x / scale is computed in the layer's dtype (bf16/fp16) before the E4M3 cast: two roundings",
        link=None, reason="no upstream report found (searched google/flax issues and PRs for fp8_ops quantize "
                          "compute_dtype rounding); quantize() divides in compute_dtype",
        test=_F + "test_flax_fp8_ops.py::test_bf16_input_is_rounded_once"),
    *_peer_entries(
        "quanto-bf16-double-rounding", "quanto-qfloat8", ("quantize.codes",),
        applies="optimum-quanto 0.2.7, bf16 weights",
        what="w / scale is rounded to bf16 before E4M3 (quantize_symmetric divides in w's dtype)",
        link=None, reason="no upstream report found",
        test=_F + "test_quanto_qfloat8.py::test_bf16_weights_are_rounded_once"),
    *_peer_entries(
        "quanto-zero-row-nan", "quanto-qfloat8", ("quantize.scale", "quantize.sign_symmetry"),
        applies="optimum-quanto 0.2.7",
        what="an all-zero output channel gets scale 0 and NaN codes",
        link=None, reason="no upstream report found; absmax_scale has no floor",
        test=_F + "test_quanto_qfloat8.py::test_all_zero_output_channel_quantizes_to_zero_codes"),
    *_peer_entries(
        "jax-mxfp8-zero-block-nan", "jax-mxfp8",
        ("quantize.codes", "quantize.scale", "quantize.scale_equivariance", "quantize.sign_symmetry"),
        applies="jax 0.10.2 on XLA:CPU, bf16 or fp32 input",
        what="an all-zero (or all-subnormal) 32-block gets E8M0 code 0, whose 2**-127 stand-in XLA:CPU flushes to "
             "0: NaN codes",
        link=None, reason="no upstream report found (same class: flashinfer#2440); XLA:CPU flushes subnormals",
        test=_F + "test_jax_mxfp8.py::test_all_zero_block_quantizes_to_zero_codes"),
    *_peer_entries(
        "jax-mxfp8-fp16-subnormal-scale", "jax-mxfp8", ("quantize.exact_on_pow2_scale",),
        applies="jax 0.10.2 on XLA:CPU, fp16 input, a 32-block with amax < 448 * 2**-14 (about 0.027)",
        what="x / e8m0_to_dtype(scale, fp16): the block's E8M0 scale is an fp16 subnormal, which XLA:CPU "
             "flushes to 0, so x / 0 = Inf clips to 448: every code of the block saturates (241.6 -> 448)",
        link=None, reason="no upstream report found; the same XLA:CPU flush as jax-mxfp8-zero-block-nan, "
                          "reached through the fp16 scale",
        test=_F + "test_jax_mxfp8.py::test_small_fp16_block_keeps_its_codes"),
    *_peer_entries(
        "quanto-qbytes-mm-scale-product-underflow", "quanto-qbytes-mm",
        ("scaled_mm.bound", "scaled_mm.scale_equivariance"),
        applies="optimum-quanto 0.2.7, CPU qbytes_mm, bf16 scales whose product is below 2**-133",
        what="QBytesTensor's matmul passes input._scale * other._scale, multiplied in bf16, and qbytes_mm scales "
             "the weight codes in bf16: a scale product below bf16's smallest subnormal is 0, so the output is 0 "
             "(scales 2**-70 each: 0 for 5.8e-36)",
        link=None, reason="no upstream report found (searched huggingface/optimum-quanto: qbytes_mm scale underflow "
                          "bfloat16); same class: ikawrakow/ik_llama.cpp#2498 (scales multiplied in fp16)",
        test=_F + "test_quanto_qbytes_mm.py::test_tiny_scales_keep_a_normal_result"),
    *_peer_entries(
        "jax-xla-dot-ftz", "jax-xla-dot", ("scaled_mm.bound",),
        applies="jax 0.10.2 on XLA:CPU, a GEMM output below 2**-126 (tiny scales)",
        what="XLA:CPU compiles with flush-to-zero: a subnormal fp32 result of dot(a, b) * sa * sb + bias is "
             "returned as +-0 (-0.0 for -12 x 2**-140)",
        link="https://github.com/openxla/xla/issues/22858",
        reason="by design: XLA:CPU sets denormal-fp-math=preserve-sign (openxla/xla#22858, open feature request "
               "for an option; PR #35740 closed unmerged)",
        test=_F + "test_jax_xla_dot.py::test_subnormal_scaled_product_is_kept"),
    *_peer_entries(
        "modelopt-tiny-amax", "modelopt-fp8", ("quantize.scale", "quantize.codes", "quantize.scale_equivariance"),
        applies="nvidia-modelopt 0.47.0, CPU fake quantization (_fp8_eager)",
        what="amax <= 2**-24 is replaced by 1: a block of tiny values quantizes to zero codes",
        link=None, reason="no upstream report found; the CUDA kernel has the same rule (Model-Optimizer PR #381)",
        test=_F + "test_modelopt_fp8.py::test_a_tiny_block_keeps_its_values"),
    *_peer_entries(
        "openvino-f8-via-f16", "openvino-onnx-qdq", ("quantize.codes", "quantize.exact_on_pow2_scale"),
        applies="openvino 2026.4.1, CPU plugin (x86-64 JIT), f32 -> f8e4m3 / f8e5m2 (FakeConvert in the ONNX "
                "frontend's QuantizeLinear)",
        what="f32 -> FP8 is rounded twice, through fp16: 1.0625 + 2**-20 gives 1.0 (RNE: 1.125)",
        link="https://github.com/openvinotoolkit/openvino/pull/28501",
        reason="by design since openvino PR #28501 (2-step f32 -> f16 -> f8 conversion, to match oneDNN's "
               "fp8 emulation; oneDNN PR #2361 documents it); OpenVINO's earlier reference rounded once",
        test=_F + "test_openvino_fp8.py::test_f32_to_fp8_rounds_once"),
    *_peer_entries(
        "openvino-f8-via-f16-convert", "openvino-convert", ("quantize.codes",),
        applies="openvino 2026.4.1, CPU plugin (x86-64 JIT), Convert f32 -> f8e4m3 / f8e5m2",
        what="f32 -> FP8 is rounded twice, through fp16 (the same conversion as openvino-f8-via-f16)",
        link="https://github.com/openvinotoolkit/openvino/pull/28501",
        reason="by design since openvino PR #28501 (2-step f32 -> f16 -> f8 conversion)",
        test=_F + "test_openvino_fp8.py::test_f32_to_fp8_rounds_once"),
    *_peer_entries(
        "openvino-convert-fp8-overflow", "openvino-convert",
        ("quantize.exact_on_pow2_scale", "quantize.sign_symmetry"),
        applies="openvino 2026.4.1, Convert to f8e4m3 / f8e5m2 (CPU plugin), a static scale that x / s overflows",
        what="Convert does not saturate: a value that rounds past 448 (and Inf) becomes NaN in f8e4m3, past "
             "57344 Inf in f8e5m2",
        link=None,
        reason="no upstream report found (searched openvino issues and PRs: f8e4m3 Convert overflow NaN "
               "saturation); Convert is non-saturating by design (openvino PR #28651 adds the clamp to "
               "FakeConvert's decomposition only; oneDNN PR #3675 to saturate was closed)",
        test=_F + "test_openvino_fp8.py::test_convert_to_fp8_saturates"),
    *_peer_entries(
        "openvino-fakeconvert-nan", "openvino-onnx-qdq", (),
        applies="openvino 2026.4.1, FakeConvert on the CPU plugin (the ONNX frontend's QuantizeLinear)",
        what="NaN becomes -448 (E4M3) or -57344 (E5M2), the most negative finite code; ONNX keeps NaN",
        link="https://github.com/openvinotoolkit/openvino/pull/28651",
        reason="FakeConvert clamps NaN as well as overflow (openvino PR #28651, by design); fp8ref's spec raises "
               "on NaN input, so no contract sees it directly: it shows through openvino-divide-reciprocal-"
               "subnormal",
        test=_F + "test_openvino_fp8.py::test_quantize_linear_keeps_nan"),
    *_peer_entries(
        "openvino-divide-reciprocal-subnormal", "openvino-onnx-qdq", ("quantize.sign_symmetry",),
        applies="openvino 2026.4.1, CPU plugin, a subnormal scale (subnormal scales kept, no amax floor)",
        what="Divide(x, s) runs as x * (1 / s): for a subnormal s the reciprocal is Inf, 0 / s is NaN, "
             "which QuantizeLinear turns into -448",
        link=None,
        reason="no upstream report found (searched openvino issues and PRs: Divide reciprocal Power denormal); "
               "the ConvertDivide transformation rewrites Divide as Multiply(x, Power(s, -1))",
        test=_F + "test_openvino_fp8.py::test_division_by_a_subnormal_scale"),
    *_peer_entries(
        "sglang-scaled-mm-bias-rounding", "sglang-scaled-mm", (),
        applies="sglang 0.5.23 triton_scaled_mm with a bias",
        what="the bias is added after rounding acc * scales to the output dtype: two roundings (vLLM's copy adds "
             "it to the fp32 accumulator)",
        link=None, reason="no upstream report found; certified as declared (output_roundings=2, standard class)",
        test=_F + "test_sglang_scaled_mm_bias.py::test_bias_is_added_before_the_output_rounding"),
    *_peer_entries(
        "lmdeploy-blocked-gemm-scale-reciprocal", "lmdeploy-blocked-gemm",
        ("scaled_mm.bound", "scaled_mm.all_written", "scaled_mm.finite", "scaled_mm.sign_symmetry"),
        applies="lmdeploy 0.18.0 blocked_gemm_fp8 (TritonLinearBlockedF8Impl), a K-tile scale product a_s * b_s "
                "of 0 or at most 2**-128",
        what="the accumulator is rescaled by 1 / s_0 and s_(k-1) / s_k (s_k = a_s * b_s of K tile k): a zero "
             "weight-block scale or a product whose reciprocal overflows fp32 gives 0 * inf = NaN outputs",
        link=None, reason="no upstream report found (searched InternLM/lmdeploy issues and pull requests for "
                          "blocked_gemm_fp8, blocked fp8 NaN, weight_scale_inv zero); the kernel carries its "
                          "accumulator in units of the current tile's scale product instead of adding "
                          "dot * a_s * b_s",
        test=_F + "test_lmdeploy_blocked_gemm.py::test_zero_weight_block_scale_contributes_zero"),
    *_peer_entries(
        "lmdeploy-smooth-quant-zero-channel-nan", "lmdeploy-smooth-quant-fp8-weights",
        ("quantize.codes", "quantize.scale", "quantize.sign_symmetry"),
        applies="lmdeploy 0.18.0 per_channel_quant (QLinear.from_float: lite smooth_quant --quant-dtype fp8)",
        what="an all-zero output channel gets scale 0 and NaN codes (0/0)",
        link=None, reason="no issue or pull request found (searched InternLM/lmdeploy: per_channel_quant, smooth_quant "
                          "fp8 NaN, zero scale; related: lmdeploy#3318 'Using Smooth Quant to perform FP8 quantization "
                          "corrupts the model', open); a later revision of w8a8_kernels.py in the public code index "
                          "clamps the scale at finfo(float32).tiny ('A zero channel otherwise produces 0 / 0')",
        test=_F + "test_lmdeploy_w8a8.py::test_all_zero_output_channel_quantizes_to_zero_codes"),
    *_peer_entries(
        "lmdeploy-w8a8-bias-rounding", "lmdeploy-w8a8-scaled-mm", (),
        applies="lmdeploy 0.18.0 matmul_kernel_dynamic_quant with a bias (TritonLinearW8A8Impl)",
        what="the bias is added after rounding acc * scales to the output dtype (c += bias): two roundings",
        link=None, reason="no upstream report found; certified as declared (output_roundings=2, standard class)",
        test=_F + "test_lmdeploy_w8a8.py::test_bias_is_added_before_the_output_rounding"),
    # keras' float8 Dense: the same source on the torch and the jax backend (rows keras-dense-float8-*,
    # keras-jax-dense-float8-*); on jax, XLA:CPU also flushes a subnormal scale to 0 (finding 25)
    *(entry for be in ("", "jax-") for entry in _peer_entries(
        f"keras-float8-fp32-bias-bf16{'-' + be[:-1] if be else ''}", f"keras-{be}dense-float8-fp32", ("linear.bound",),
        applies="keras 3.15.1 Dense.quantize('float8'), fp32 layers with a bias",
        what="_float8_call rounds an fp32 layer's bias to bf16 before adding it (a TensorFlow fusion "
             "workaround, tensorflow PR #60306, applied on every backend)",
        link=None, reason="no upstream report found (searched keras-team/keras: Dense float8 bias bfloat16)",
        test=_F + "test_keras_float8.py::test_fp32_layer_adds_its_bias_unrounded")),
    *(entry for dt in ("bf16", "fp32") for entry in _peer_entries(
        f"keras-float8-tiny-amax-zero-scale-{dt}", f"keras-dense-float8-{dt}", ("linear.bound",),
        applies=f"keras 3.15.1 Dense.quantize('float8'), {dt} layers, a tensor with amax below 448 / FLT_MAX "
                "(about 1.3e-36)",
        what="compute_float8_scale forms 448 / amax, which overflows to Inf, and returns 1 / Inf = 0: the "
             "tensor dequantizes to 0 (x / 0 clips to +-448, times 0), its zeros to NaN",
        link=None, reason="no upstream report found (searched keras-team/keras issues and PRs: float8 scale "
                          "amax overflow zero)",
        test=_F + "test_keras_float8.py::test_tiny_tensor_gets_a_nonzero_scale")),
    *(entry for dt in ("bf16", "fp32") for entry in _peer_entries(
        f"keras-float8-tiny-amax-zero-scale-jax-{dt}", f"keras-jax-dense-float8-{dt}", ("linear.bound",),
        applies=f"keras 3.15.1 on jax (XLA:CPU), {dt} layers, a tensor with amax below 448 x 2**-126 (about 5.3e-36)",
        what="compute_float8_scale's 1 / (448 / amax) is 0 below 448 / FLT_MAX and subnormal up to 448 x 2**-126, "
             "which XLA:CPU flushes to 0: the tensor dequantizes to 0, its zeros to NaN",
        link=None, reason="no upstream report found (searched keras-team/keras issues and PRs: float8 scale "
                          "amax overflow zero)",
        test=_F + "test_keras_float8.py::test_tiny_tensor_gets_a_nonzero_scale_on_jax")),
    *_peer_entries(
        "keras-float8-jax-fp16-reciprocal-overflow", "keras-jax-dense-float8-fp16", ("linear.bound",),
        applies="keras 3.15.1 on jax (XLA:CPU), fp16 layers, a tensor with amax below about 448 x 2**-16 (6.8e-3)",
        what="XLA:CPU evaluates quantize_and_dequantize's fp16 x / scale (a 0-d scale) as x * (1 / scale) with "
             "the reciprocal in fp16, which overflows to Inf for a scale below about 2**-16: every code saturates "
             "at +-448 (flax's quantize broadcasts the scale first and is not affected)",
        link=None, reason="no upstream report found (searched openxla/xla and jax-ml/jax issues: float16 division "
                          "reciprocal overflow on CPU; keras-team/keras: float8 float16)",
        test=_F + "test_keras_float8.py::test_jax_fp16_small_tensor_keeps_its_values"),
    *(entry for be in ("", "jax-") for entry in _peer_entries(
        f"keras-float8-fp16-scale-underflow{'-' + be[:-1] if be else ''}", f"keras-{be}dense-float8-fp16",
        ("linear.bound",),
        applies="keras 3.15.1 Dense.quantize('float8'), fp16 layers, a tensor with amax below 448 x 2**-25",
        what="quantize_and_dequantize casts the fp32 scale to fp16, where a scale below 2**-25 is 0: the tensor "
             "dequantizes to 0 and its zeros to NaN",
        link=None, reason="no upstream report found (searched keras-team/keras: quantize_and_dequantize float16 "
                          "scale underflow)",
        test=_F + "test_keras_float8.py::test_fp16_small_tensor_keeps_its_values")),
    *(entry for be in ("", "jax-") for dt in ("bf16", "fp16") for entry in _peer_entries(
        f"keras-float8-double-rounding-{be}{dt}", f"keras-{be}dense-float8-{dt}", (),
        applies=f"keras 3.15.1 quantize_and_dequantize, {dt} layers",
        what="x / scale is computed in the layer's dtype before the E4M3 cast: two roundings (flax's finding 15); "
             "within the linear bound on every example drawn, visible in the bit-exact column",
        link=None, reason="no upstream report found (searched keras-team/keras: float8 quantize compute dtype "
                          "rounding)",
        test=_F + "test_keras_float8.py::test_bf16_input_is_rounded_once")),
]

#: Loader findings (docs/certified-loaders.md): ``backend`` is the loader row's name, ``property`` a
#: loader contract; ``python -m fp8ref.peers.loaders`` applies them to ``check_loader``'s reports.
_ALL_LOAD = ("load.partitions", "load.tp_shards", "load.reload_idempotent", "load.source_dtypes",
             "load.no_uninitialised")
_CEIL = dict(
    applies="vllm 0.33.0 block-quantized (weight_block_size [128, 128]) fused layers whose partitions are not "
            "multiples of 128 rows",
    what="weight_scale_inv has ceil(sum(N_p) / 128) rows and partition p's scale rows are written at "
         "ceil(offset_p / 128) (adjust_block_scale_shard): later partitions overwrite earlier rows, rows read a "
         "neighbour's scale; [64, 64] raises at load",
    link=None, reason="the class of vllm#52997, vllm#52915, vllm-ascend#15346 (cited by issue 41, not re-verified)",
    test=_F + "test_vllm_fp8_loading.py::test_partitions_not_multiples_of_the_block_get_their_own_scale_rows")
_REQUANT = dict(
    what="requantize_with_max_scale dequantizes each partition as weight.to(float16) * scale: a rounding to fp16 "
         "between the checkpoint's codes and the requantized ones (1.001x one requantization's bound on normal "
         "weights, more near 1e-7; Inf above 65504)",
    link=None, reason="no upstream report found; per_tensor_dequantize casts the codes to fp16 and a 0-dim fp32 "
                      "scale keeps fp16")
KNOWN_FAILURES += [
    *(entry for name in ("vllm-fp8-load-merged-block", "vllm-fp8-load-qkv-block") for entry in _peer_entries(
        f"vllm-block-scale-ceil-offset-{name}", name, _ALL_LOAD, **_CEIL)),
    *_peer_entries("vllm-requantize-fp16-dequantize-merged", "vllm-fp8-load-merged-tensor", _ALL_LOAD[1:],
                   applies="vllm 0.33.0 per-tensor FP8 checkpoints (fused layers)",
                   test=_F + "test_vllm_fp8_loading.py::test_requantize_dequantizes_without_an_fp16_rounding",
                   **_REQUANT),
    *_peer_entries("vllm-requantize-fp16-dequantize-row", "vllm-fp8-load-row-tensor", ("load.source_dtypes",),
                   applies="vllm 0.33.0 per-tensor FP8 checkpoints (one partition, weights near 1e-7)",
                   test=_F + "test_vllm_fp8_loading.py::test_requantize_dequantizes_without_an_fp16_rounding",
                   **_REQUANT),
    *_peer_entries("sglang-requantize-fp16-dequantize", "sglang-fp8-load-merged-tensor", _ALL_LOAD[1:],
                   applies="sglang 0.5.23 per-tensor FP8 checkpoints off the CUTLASS channelwise path (SM120, ROCm "
                           "without aiter per-token, CUDA before SM89, non-CUDA devices; fused layers)",
                   test=_F + "test_sglang_fp8_loading.py::test_requantize_dequantizes_without_an_fp16_rounding",
                   **_REQUANT),
    *_peer_entries(
        "vllm-online-per-tensor-zero-scale", "vllm-online-fp8-load-merged-tensor", ("load.source_dtypes",),
        applies="vllm 0.33.0 quantization='fp8_per_tensor' on an fp16/bf16 checkpoint, an all-zero (fused) weight",
        what="s = amax / 448 with no floor: an all-zero weight stores scale 0 (codes 448: the static quantizer's "
             "0 * (1 / 0) = NaN clamps to 448 through fminf); it dequantizes to 0, but the stored scale is not "
             "positive",
        link=None, reason="no upstream report found; _fp8_scale has no floor (the per-channel path floors at "
                          "1 / (448 * 512), per_block_cast_to_fp8 at 1e-4)",
        test=_F + "test_vllm_fp8_loading.py::test_online_per_tensor_scale_of_an_all_zero_weight_is_positive"),
]


def known_failure(id: str) -> dict:
    """The ledger entry called ``id`` (KeyError listing the ids otherwise)."""
    for entry in KNOWN_FAILURES:
        if entry["id"] == id:
            return entry
    raise KeyError(f"no known failure {id!r}; ids: {[e['id'] for e in KNOWN_FAILURES]}")


def xfail(id: str):
    """``pytest.mark.xfail(strict=True)`` for ledger entry ``id``, with its link in the reason."""
    import pytest

    entry = known_failure(id)
    return pytest.mark.xfail(strict=True, reason=f"{entry['what']} ({entry['link'] or 'no upstream link'})")
