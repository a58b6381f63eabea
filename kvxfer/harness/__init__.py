"""Standalone runs that check a machine: two-process loopback handoffs and soaks.

``child`` is the one two-process harness (a spawned child, a pipe, the child's own
error delivered to the parent) that loopback, soak and the bench share;
``progress`` is the delayed progress display the CLI wraps around them.

Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""
