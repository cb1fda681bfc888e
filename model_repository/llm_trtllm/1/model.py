"""The TensorRT-LLM client convention under the name `llm_trtllm`: paged_llm/serving/trtllm_model.py."""

from paged_llm.serving.trtllm_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
