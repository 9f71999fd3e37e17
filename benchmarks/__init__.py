"""The benchmarks: ``python -m benchmarks [--quick] [--only NAME ...]`` from the checkout's root
(``benchmarks/README.md``; one module per benchmark, ``common`` and ``process_tree`` shared)."""
