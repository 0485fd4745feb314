"""Certify naive-fp8 from Python (no pytest): ``python certify.py [PROFILE]``; exit status 1 on a failure."""

import sys

from fp8ref.conformance import check

from naive_fp8 import NaiveFp8Backend

report = check(NaiveFp8Backend(), profile=sys.argv[1] if len(sys.argv) > 1 else "ci")
print(report.to_text())
sys.exit(0 if report.passed else 1)
