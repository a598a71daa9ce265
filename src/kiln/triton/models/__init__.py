"""The Triton Python models kiln ships into model repositories (source files, not imported by kiln).

Each ``<kind>/model.py`` is copied into a repository as ``<model>/1/model.py`` by
:func:`kiln.triton.repository.install_python_model`, together with the files it imports from here:
:mod:`kiln_triton_utils <kiln.triton.models.kiln_triton_utils>` (parameters, paths, request errors, streamed
text; kiln's linter uses it too) and, for kiln bench's mock LLM, ``mock_llm/mock_tokens.py``. Those two are
the only modules here that kiln imports; they need neither kiln nor ``triton_python_backend_utils``.
"""
