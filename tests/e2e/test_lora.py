"""LoRA adapters through tritonserver, as their users call them: Triton's `llm` model with
`lora_name` in sampling_parameters (an adapter from config.pbtxt's lora_modules and one from
vllm_backend's multi_lora.json), and `paged-llm serve --lora-modules` with the openai SDK, where the
request's `model` is the adapter. Greedy tokens equal HF transformers + PEFT with the same files."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from paged_llm.launcher.repository import make_model_repository
from paged_llm.lora.random_adapter import write_random_adapter
from paged_llm.testing.server_process import stop_process_group
from tests.e2e.client import http_post, stream
from tests.e2e.metrics import value, wait_for, wait_idle
from tests.e2e.server import RunningServer, start_server
from tests.e2e.test_launcher import start_served

PROMPT = "The adapters of a base model"
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": write_random_adapter(tiny_model_dir, root / "alpha", rank=8, seed=11),
        "beta": write_random_adapter(
            tiny_model_dir, root / "beta", rank=4, seed=12, target_modules=("v_proj",)
        ),
    }


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_tokenizer, adapters):
    """(adapter or None) -> HF transformers (+ PEFT) greedy token ids for PROMPT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompt = list(tiny_tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    ids = torch.tensor([prompt])
    expected = {}
    for name in (None, *adapters):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, str(adapters[name])).eval()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        expected[name] = out[0, len(prompt) :].tolist()
    assert len({tuple(v) for v in expected.values()}) == 3
    return expected


@pytest.fixture(scope="module")
def triton(tmp_path_factory, adapters) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("lora_triton")
    repository = make_model_repository(
        root / "models", {"lora_modules": f"alpha={adapters['alpha']}", "dtype": "float32"}, models=("llm",)
    )
    (repository / "llm" / "1" / "multi_lora.json").write_text(json.dumps({"beta": str(adapters["beta"])}))
    running = start_server(repository, root / "server.log")
    yield running
    running.stop()


def output_ids(result) -> list[int]:
    return [int(t) for response in result.responses for t in response.as_numpy("output_ids")]


def test_triton_lora_name_selects_the_adapter(triton, reference):
    for name in (None, "alpha", "beta"):
        params = GREEDY if name is None else {**GREEDY, "lora_name": name}
        result = stream(triton.grpc_url, PROMPT, stream=True, sampling_parameters=params)
        assert not result.errors and result.finals == 1
        assert output_ids(result) == reference[name], name
    unknown = stream(triton.grpc_url, PROMPT, sampling_parameters={**GREEDY, "lora_name": "gamma"})
    assert len(unknown.errors) == 1
    assert "lora_name: LoRA adapter 'gamma' is not loaded (loaded: 'alpha', 'beta')" in unknown.errors[0]
    wait_idle(triton)

    def counted() -> bool:  # the request counters go with each final, the engine's every 0.5 s
        text = triton.metrics()
        return (
            all(value(text, "paged_llm_lora_requests_total", lora_name=n) == 1 for n in ("alpha", "beta"))
            and value(text, "paged_llm_lora_adapter_loads_total") == 2
        )

    assert wait_for(counted), triton.metrics()[-3000:]
    text = triton.metrics()
    assert value(text, "paged_llm_lora_adapter_evictions_total") == 0
    assert value(text, "paged_llm_lora_slots_used") == 2


@pytest.fixture(scope="module")
def served(tmp_path_factory, adapters):
    root = tmp_path_factory.mktemp("lora_serve")
    running = start_served(
        root, "--dtype", "float32", "--lora-modules", f"alpha={adapters['alpha']}", f"beta={adapters['beta']}"
    )
    try:
        yield running
    finally:
        stop_process_group(running.process)


def test_the_openai_model_name_selects_the_adapter(served, reference, tiny_tokenizer):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="none")
    listed = {card.id: getattr(card, "parent", None) for card in client.models.list().data}
    assert listed == {"llm": None, "alpha": "llm", "beta": "llm"}
    for model, name in (("llm", None), ("alpha", "alpha"), ("beta", "beta")):
        completion = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert completion.model == model
        assert completion.choices[0].text == tiny_tokenizer.decode(reference[name]), model
    with pytest.raises(openai.NotFoundError, match="The model `gamma` does not exist"):
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)


@pytest.fixture(scope="module")
def served_runtime(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_runtime")
    running = start_served(root, "--dtype", "float32", "--allow-runtime-lora-updates")
    try:
        yield running
    finally:
        stop_process_group(running.process)


def test_adapters_load_and_unload_while_serving_through_the_openai_server(
    served_runtime, adapters, reference, tiny_tokenizer
):
    address = f"127.0.0.1:{served_runtime.port}"
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="none")

    def complete(model: str):
        return client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )

    with pytest.raises(openai.NotFoundError, match="The model `alpha` does not exist"):
        complete("alpha")
    status, text = http_post(
        address, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["alpha"])}
    )
    assert status == 200 and text == "Success: LoRA adapter 'alpha' added successfully."
    assert complete("alpha").choices[0].text == tiny_tokenizer.decode(reference["alpha"])
    assert {card.id: getattr(card, "parent", None) for card in client.models.list().data} == {
        "llm": None,
        "alpha": "llm",
    }
    status, text = http_post(address, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": "/nowhere"})
    assert status == 400 and "lora_path" in text and "adapter_config.json" in text
    status, text = http_post(address, "/v1/unload_lora_adapter", {"lora_name": "alpha"})
    assert status == 200 and text == "Success: LoRA adapter 'alpha' removed successfully."
    with pytest.raises(openai.NotFoundError, match="The model `alpha` does not exist"):
        complete("alpha")
    status, text = http_post(address, "/v1/unload_lora_adapter", {"lora_name": "alpha"})
    assert status == 404 and "'alpha' is not loaded" in text
    status, text = http_post(
        address, "/v1/load_lora_adapter", {"lora_name": "llm", "lora_path": str(adapters["beta"])}
    )
    assert status == 400 and "the name of a served model" in text
    assert complete("llm").choices[0].text == tiny_tokenizer.decode(reference[None])

    def metrics_text() -> str:
        url = f"http://127.0.0.1:{served_runtime.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    # an adapter loaded while serving is counted under its name; a name the core refused (runtime
    # updates leave the check to it) makes no series
    refused = stream(
        f"127.0.0.1:{served_runtime.grpc_port}", PROMPT, sampling_parameters={**GREEDY, "lora_name": "gamma"}
    )
    assert len(refused.errors) == 1 and "'gamma' is not loaded" in refused.errors[0]
    counted = wait_for(lambda: value(metrics_text(), "paged_llm_lora_requests_total", lora_name="alpha") == 1)
    assert counted, metrics_text()[-3000:]
    assert 'lora_name="gamma"' not in metrics_text()
