"""CUDA back end: driver bindings (`driver`), device, allocator and module loader (`device`).

Importing this package loads nothing; `tinydist.runtime.cuda.driver.load()` dlopens libcuda and
calls cuInit on first use. See docs/cuda.md.
"""
