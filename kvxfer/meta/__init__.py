"""The wire between two kvxfer processes, in one package: what a backend exports and a peer parses.

- ``version``: the one wire version and its history (every part below carries it);
- ``geometry``: the geometry schema every backend's ``export_meta()`` starts with, and its parser;
- ``records``: the per-request shapes an engine hands a backend (flat, ``tp_metas``, ``pp_metas``),
  unwrapped into source records and parsed once, into the typed records ``kvxfer.plan`` takes;
- ``seal``: the integrity seal and cluster-key signature over an exported meta;
- ``notice``: the read-done / read-failed notice every transport sends its source;
- ``agreement``: the fields two engines must agree on before KV moves between them;
- ``capabilities``: the fields that let their holder read a pool, encrypted under the cluster key.
A transport's own section of the meta (NIXL agent metadata, UCX worker address and rkeys) is
typed beside its backend and stamped with the same version.

``kvxfer.plan`` gives it the typed records it parses into, ``kvxfer.security`` the cluster key the
seal signs with. Nothing here does I/O beyond reading the key file.
Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py (docs/architecture.md, "Layers").
"""
