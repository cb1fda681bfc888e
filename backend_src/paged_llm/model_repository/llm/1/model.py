"""The `llm` model (decoupled): its code is the package's, paged_llm/triton_model/llm_model.py."""

from paged_llm.triton_model.llm_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
