"""Mutant backends that the conformance suite must reject, and correct variants it must accept."""
