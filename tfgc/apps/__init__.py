"""The applications built on the library: ``tfgc-train`` (``train``), ``tfgc-launch``
(``launch``), the trainer's built-in data sets (``data``) and models (``models``), user
entry points for both (``entry_points``) and the SVG plots of the demo and the
benchmarks (``plots``).

The library (``tfgc.compressors``, ``tfgc.collectives``, ``tfgc.distribute``,
``tfgc.keras``, ``tfgc.ops``) never imports from here; ``tests/test_layering.py`` keeps
it so.
"""
