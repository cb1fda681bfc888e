"""The TensorRT-LLM client convention under the name `ensemble`: paged_llm/triton_model/trtllm_model.py."""

from paged_llm.triton_model.trtllm_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
