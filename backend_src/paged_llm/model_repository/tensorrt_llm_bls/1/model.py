"""`tensorrt_llm_bls`, of the TensorRT-LLM client convention: paged_llm/triton_model/trtllm_model.py."""

from paged_llm.triton_model.trtllm_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
