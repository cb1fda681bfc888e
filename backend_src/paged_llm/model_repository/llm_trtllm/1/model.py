"""The TensorRT-LLM client convention under the name `llm_trtllm`: paged_llm/triton_model/trtllm_model.py."""

from paged_llm.triton_model.trtllm_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
