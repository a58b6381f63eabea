"""Fleet benchmarks: measurements of the engine layer (real fleets and plane-only simulated ones).

``fleet_prefix`` (prefix-aware against least-loaded routing on a real 1 x 2 fleet, both planes),
``fleet_scale`` (control-plane operations and latency per handoff as simulated fleets grow) and
``fleet_sim`` (the simulated engine hosts it launches). They live here, not in ``kvxfer.bench``,
because they drive ``engine_integration``: the library never imports the engine layer. Their
command-line faces are ``kvxfer bench-prefix-routing`` and ``kvxfer bench-fleet-scale``
(``kvxfer.cli.bench_fleet``, the front door, which may import both layers).

Its imports: its row of ``LAYERS`` in tests/project/test_library_layout.py.
"""
