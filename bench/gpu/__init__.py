"""The parts of ``bench/gpu_check.py``: one module per part, plus the shapes they build
(``shapes``), where they meet work still in flight (``adapters``) and how each records
its results (``record``)."""
