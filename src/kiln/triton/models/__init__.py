"""The Triton Python models kiln ships into model repositories (source files, not imported by kiln).

Each ``<kind>/model.py`` is copied into a repository as ``<model>/1/model.py`` by
:func:`kiln.triton.repository.install_python_model`, together with
:mod:`kiln_triton_utils <kiln.triton.models.kiln_triton_utils>` (parameters, paths, request errors, streamed
text), the one module here that kiln imports too (its linter reads parameters with it). It needs neither kiln
nor ``triton_python_backend_utils``.
"""
