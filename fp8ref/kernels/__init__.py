"""Backends (the design card's ``kernels/``, shipped as ``fp8ref.kernels``): one module each.

Each module registers its backend on import; ``fp8ref.registry`` imports them lazily.
"""
