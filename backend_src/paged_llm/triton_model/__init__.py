"""Everything that runs inside a Triton Python-backend stub: the `llm` model (llm_model.py), the
TensorRT-LLM-convention models that forward to it (trtllm_model.py), and their parts (request and
response codecs, response streams, metrics, the health probe, the API-key check, server watches).

The model repository's model.py files only import these classes (paged_llm/model_repository/).
"""
