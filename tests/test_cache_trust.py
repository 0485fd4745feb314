"""The selection cache is a hint, never a verdict (issue 40; docs/selection.md, "The cache's trust
model"): a cache file cannot make ``auto`` run a backend the probe rejects, one outside the caller's
candidates or one the allow-list does not admit; files of another user or writable by others are
refused; links are not followed; unreadable, deeply nested or wrongly typed content is absent."""

from __future__ import annotations

import json
import os
import re
import sys
import warnings

import pytest
import torch

import fp8ref
from fp8ref import registry
from fp8ref import select as sel
from fp8ref.registry import Backend
from fp8ref.select import cache, selector, trust
from fp8ref.select.decision import Decision

L = sys.modules["fp8ref.api"]
CASE = fp8ref.Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8)


class Exact(Backend):
    """The spec under another name (exact class): compliant."""

    name = "t-trust-good"
    accumulation = fp8ref.Accumulation.EXACT

    def quantize(self, x, scheme):
        return fp8ref.quantize(x, scheme)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp8ref.scaled_mm(a, b, bias, out_dtype)


class TimesOneAndAHalf(Exact):
    """Outputs x1.5: the probe rejects it."""

    name = "t-trust-bad"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return (fp8ref.scaled_mm(a, b, bias, torch.float32) * 1.5).to(out_dtype)


@pytest.fixture()
def iso(tmp_path, monkeypatch):
    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path / "cache"))
    for var in (sel.ENV_BACKEND, sel.ENV_CANDIDATES, registry.ENV_ALLOW):
        monkeypatch.delenv(var, raising=False)
    sel.clear_cache()
    L.clear_weight_cache()
    good = fp8ref.register_backend(Exact(), replace=True)
    bad = fp8ref.register_backend(TimesOneAndAHalf(), replace=True)
    yield good, bad
    for b in (good, bad):
        fp8ref.unregister_backend(b.name)
    sel.clear_cache()
    L.clear_weight_cache()


def _plant(key: str, chosen: str, ranking: list[str], **changes) -> None:
    """Rewrite the cache entry under ``key`` as someone without the seal's secret would."""
    path = cache.cache_file()
    data = json.loads(path.read_text())
    entry = data["entries"][key]
    entry.update(chosen=chosen, ranking=ranking, **changes)
    entry.pop("attest", None)
    path.write_text(json.dumps(data))
    sel.clear_cache()  # a fresh process: nothing in memory


def _counting_probes(monkeypatch) -> list[str]:
    probed: list[str] = []
    real = selector.probe

    def counting(b, case, **kw):
        probed.append(b.name)
        return real(b, case, **kw)

    monkeypatch.setattr(selector, "probe", counting)
    return probed


def test_a_probe_rejected_backend_planted_in_the_cache_is_probed_again_and_refused(iso, monkeypatch):
    good, bad = iso
    d = sel.select(CASE, candidates=[bad.name])
    assert d.chosen == "reference" and bad.name not in d.ranking  # the probe rejects x1.5
    _plant(d.key, bad.name, [bad.name, "reference"])
    probed = _counting_probes(monkeypatch)
    with pytest.warns(UserWarning, match=rf"{bad.name}.*probed again: the probe rejects it"):
        d2 = sel.select(CASE, candidates=[bad.name])
    assert d2.chosen == "reference" and bad.name not in d2.ranking and d2.source == "probe"
    assert probed.count(bad.name) == 2  # once to check the hint, once in the fresh selection
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    assert torch.equal(fp8ref.linear(x, w, candidates=[bad.name]), fp8ref.reference_linear(x, w))


def test_a_sealed_verdict_is_used_without_a_probe_and_a_broken_seal_costs_one(iso, monkeypatch):
    good, _ = iso
    d = sel.select(CASE, candidates=[good.name])
    assert good.name in d.ranking
    entry = json.loads(cache.cache_file().read_text())["entries"][d.key]
    assert set(entry["attest"]) == {good.name}  # the reference is the spec: nothing to seal
    probed = _counting_probes(monkeypatch)
    sel.clear_cache()
    assert sel.select(CASE, candidates=[good.name]).source == "disk" and probed == []
    _plant(d.key, d.chosen, d.ranking)  # the same verdict without its seal
    d3 = sel.select(CASE, candidates=[good.name])
    assert d3.source == "disk" and d3.ranking == d.ranking and probed == [good.name]
    sel.clear_cache()  # sealed again by the re-probe: the next process believes it
    assert sel.select(CASE, candidates=[good.name]).source == "disk" and probed == [good.name]


def test_the_seal_binds_the_backend_declaration(iso, monkeypatch):
    good, _ = iso
    d = sel.select(CASE, candidates=[good.name])
    probed = _counting_probes(monkeypatch)
    sel.clear_cache()
    # Another version of the backend: its seal no longer matches (the key moves too, so compare
    # the messages directly).
    before = selector._seal_messages(d.key, [good.name])
    monkeypatch.setattr(type(good), "version", "2")
    assert selector._seal_messages(d.key, [good.name]) != before
    assert trust.unsealed(trust.read_secret(cache.cache_file().parent), selector._seal_messages(d.key, [good.name]),
                          json.loads(cache.cache_file().read_text())["entries"][d.key]["attest"]) == [good.name]
    assert probed == []


def test_a_backend_outside_the_callers_candidates_is_refused(iso):
    good, _ = iso
    d = sel.select(CASE, candidates=["reference"])
    _plant(d.key, good.name, [good.name, "reference"])
    with pytest.warns(UserWarning, match=rf"'{good.name}' is not among this call's candidates"):
        d2 = sel.select(CASE, candidates=["reference"])
    assert d2.ranking == ["reference"]


def test_an_entry_point_backend_the_allow_list_does_not_name_is_refused(iso, monkeypatch):
    good, _ = iso
    monkeypatch.setattr(registry, "_ENTRY_POINT_NAMES", {good.name})  # as if installed as a plug-in
    assert not registry.is_trusted(good.name)
    cands = selector._candidates(None)
    assert good.name not in [b.name for b in cands]
    key = sel.selection_key(CASE, "standard", cands)
    ref = Decision(key, CASE.short_str(), "standard", "reference", ["reference"])
    cache.write_disk(key, ref)
    _plant(key, good.name, [good.name, "reference"])
    # What follows the refusal (a selection over every registered backend) is not under test.
    monkeypatch.setattr(selector, "_run_selection", lambda case, precision, cands, key: ref)
    with pytest.warns(UserWarning, match=rf"'{good.name}' is not among .*FP8REF_ALLOW_BACKENDS"):
        assert sel.select(CASE).chosen == "reference"
    monkeypatch.setenv(registry.ENV_ALLOW, good.name)  # allowed now: another key, its own selection
    assert good.name in [b.name for b in selector._candidates(None)]


def _one_warning(pattern: str, calls: int = 2) -> None:
    """``calls`` cold selections, all answered, with one warning matching ``pattern`` in all."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in range(calls):
            sel.clear_cache(failures=False)  # memory only: the once-per-file warnings stay said
            assert sel.select(fp8ref.Case(M=4 << m, N=32, K=64, recipe=fp8ref.W8A8_FP8),
                              candidates=["reference"]).chosen == "reference"
    hits = [str(w.message) for w in caught if re.search(pattern, str(w.message))]
    assert len(hits) == 1, [str(w.message) for w in caught]


def test_a_world_writable_cache_dir_is_refused_once_and_memory_used(iso):
    d = cache.cache_file().parent
    d.mkdir(parents=True)
    d.chmod(0o777)
    _one_warning(r"not using the selection cache in .*writable by group or others")
    assert not cache.cache_file().exists() and not any(d.iterdir())


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to give a file away")
def test_a_cache_dir_or_file_of_another_user_is_refused(iso):
    d = cache.cache_file().parent
    sel.select(CASE, candidates=["reference"])
    os.chown(cache.cache_file(), 65534, -1)
    sel.clear_cache()
    with pytest.warns(UserWarning, match=r"cannot read selection cache .*owned by uid 65534"):
        sel.select(CASE, candidates=["reference"])
    os.chown(d, 65534, -1)
    sel.clear_cache()
    with pytest.warns(UserWarning, match=r"not using the selection cache .*owned by uid 65534"):
        sel.select(CASE, candidates=["reference"])


def test_a_group_writable_cache_file_is_not_read(iso):
    d = sel.select(CASE, candidates=["reference"])
    cache.cache_file().chmod(0o666)
    sel.clear_cache()
    with pytest.warns(UserWarning, match="cannot read selection cache .*writable by group or others"):
        assert sel.select(CASE, candidates=["reference"]).source == "probe"
    assert d.chosen == "reference"


def test_a_planted_lock_symlink_is_not_followed(iso, tmp_path):
    d = cache.cache_file().parent
    d.mkdir(parents=True)
    target = tmp_path / "created-by-the-writer"
    (d / (cache.cache_file().name + ".lock")).symlink_to(target)
    with pytest.warns(UserWarning, match="cannot write selection cache .*symbolic link"):
        assert sel.select(CASE, candidates=["reference"]).chosen == "reference"
    assert not target.exists() and not cache.cache_file().exists()


def test_a_planted_key_symlink_is_not_trusted(iso, tmp_path):
    d = cache.cache_file().parent
    d.mkdir(parents=True)
    secret = tmp_path / "known-secret"
    secret.write_bytes(b"k" * trust.SECRET_BYTES)
    secret.chmod(0o600)
    (d / trust.KEY_NAME).symlink_to(secret)
    assert trust.read_secret(d) is None


def test_a_deeply_nested_cache_file_is_absent_with_one_warning(iso):
    path = cache.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text("[" * 200_000 + "]" * 200_000)
    _one_warning(r"ignoring corrupt selection cache .*RecursionError")


@pytest.mark.parametrize("field, value", [
    ("rows", "not a list"), ("rows", [1]), ("rows", [{"backend": 3, "precision": "exact"}]),
    ("rows", [{"backend": "reference", "precision": "exact", "worst_ratio": "abc"}]),
    ("rows", [{"backend": "reference", "precision": "exact", "median_s": [1]}]),
    ("rows", [{"backend": "reference", "precision": "exact", "ratios": {"q": "x"}}]),
    ("rows", [{"backend": "reference", "precision": "exact", "runs": 1.5}]),
    ("rows", [{"backend": "reference", "precision": "exact", "chosen": "yes"}]),
    ("ranking", "reference"), ("ranking", [["reference"]]), ("case", 3), ("seconds", "soon"), ("seconds", True),
])
def test_a_wrongly_typed_entry_is_absent_and_explain_still_prints(iso, field, value):
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    d = fp8ref.explain(x, w, candidates=["reference"])
    path = cache.cache_file()
    data = json.loads(path.read_text())
    data["entries"][d.key][field] = value
    path.write_text(json.dumps(data))
    with pytest.raises((TypeError, ValueError)):
        Decision.from_json(d.key, data["entries"][d.key])
    sel.clear_cache()
    with pytest.warns(UserWarning, match="ignoring malformed cache entry"):
        d2 = fp8ref.explain(x, w, candidates=["reference"])
    assert "reference" in str(d2) and d2.source == "probe"


def test_a_well_typed_entry_round_trips(iso):
    d = sel.select(CASE, candidates=["reference"])
    again = Decision.from_json(d.key, json.loads(json.dumps(d.to_json())))
    assert again.to_json() == d.to_json() and str(again)
