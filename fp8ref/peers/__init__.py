"""Third-party FP8 implementations wrapped as fp8ref backends, for ``fp8ref certify``.

One module per project; each defines ``PEERS``, a tuple of ``Peer`` instances (``fp8ref.peers._base``).
A peer is a ``Backend`` that is *not* registered: ``fp8ref.linear`` never selects third-party code,
``fp8ref certify`` judges it: the conformance driver (``fp8ref.conformance.check``) with the
peer's ``Adaptation`` (``certify.adaptation``: its conventions mapped into every problem, its
reproduce command). Importing this package
imports none of the third-party packages; a peer imports its package on first use, and
``available()`` names exactly what is missing. The subpackage ``loaders`` holds weight *loaders*
(fp8ref's own, vLLM's FP8 checkpoint loading) certified by ``fp8ref.conformance.check_loader``
(docs/certified-loaders.md).

Examples
--------
>>> from fp8ref.peers import get_peer, peer_names
>>> "onnxruntime-qdq" in peer_names()
True
>>> get_peer("torchao-float8").ops
('quantize',)
"""

from __future__ import annotations

import importlib

from ._base import Peer

__all__ = ["Peer", "PEER_MODULES", "peers", "peer_names", "get_peer"]

#: Modules defining ``PEERS``, in the order of docs/certified.md.
PEER_MODULES = (
    "fp8ref.peers.sglang",
    "fp8ref.peers.vllm",
    "fp8ref.peers.onnxruntime",
    "fp8ref.peers.torchao",
    "fp8ref.peers.compressed_tensors",
    "fp8ref.peers.jax_xla",
    "fp8ref.peers.quanto",
    "fp8ref.peers.modelopt",
    "fp8ref.peers.flax_fp8",
    "fp8ref.peers.tinygrad_fp8",
    "fp8ref.peers.quark",
    "fp8ref.peers.openvino",
    "fp8ref.peers.lmdeploy",
    "fp8ref.peers.keras_fp8",
)

_PEERS: list[Peer] | None = None


def peers() -> list[Peer]:
    """Every peer adapter (available here or not), in matrix order."""
    global _PEERS
    if _PEERS is None:
        _PEERS = [p for mod in PEER_MODULES for p in importlib.import_module(mod).PEERS]
    return list(_PEERS)


def peer_names() -> list[str]:
    return [p.name for p in peers()]


def get_peer(name: str) -> Peer:
    """The peer called ``name`` (KeyError listing the names otherwise)."""
    for p in peers():
        if p.name == name:
            return p
    raise KeyError(f"no peer named {name!r}; peers: {peer_names()}")
