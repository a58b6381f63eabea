"""One hand-off lifecycle for every engine: its states, the guard read, the quarantine.

Owns what every engine adapter (the reference engine's source and sink in ``engine_integration``,
the vLLM connector's sender and receiver, SGLang's source and puller) would otherwise write again:
``poll`` (``KVPoll``, the states of a hand-off on either side), ``guard`` (the data read, then a
guard read that carries the read-done, judged by generation counters or a lease slot; the order
kept in one place), ``generations`` (the counters a source bumps when it frees a block, and the
verified pull that reads them: the counter flavour of the guard) and ``quarantine`` (storage a
failed read may still write, held until every handle is ``storage_safe``).
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""
