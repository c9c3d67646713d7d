"""services.worker.engines.vllm_engine: what crosses into vLLM and back, without importing vLLM."""

import importlib.util
import sys

import pytest

from services.worker.engines.base import EngineError
from services.worker.engines.vllm_engine import VllmEngine, finish_reason, sampling_kwargs
from shared.schemas import Sampling


def test_module_does_not_import_vllm() -> None:
    # The worker module is importable on machines without vLLM (the CPU image).
    assert "vllm" not in sys.modules
    VllmEngine(
        model_name="m",
        model_path="/nowhere",
        tensor_parallel_size=1,
        max_seqs=2,
        gpu_memory_utilization=0.9,
        max_model_len=None,
    )
    assert "vllm" not in sys.modules


def test_sampling_kwargs_carry_every_field() -> None:
    sampling = Sampling(max_tokens=17, temperature=0.0, top_p=0.5, top_k=40, stop=["\n", "END"], seed=9)
    assert sampling_kwargs(sampling) == {
        "max_tokens": 17,
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 40,
        "stop": ["\n", "END"],
        "seed": 9,
    }


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_is_passed_as_given(top_k: int) -> None:
    # vLLM reads both 0 and -1 as "no top-k".
    assert sampling_kwargs(Sampling(top_k=top_k))["top_k"] == top_k


def test_sampling_kwargs_copy_the_stop_list() -> None:
    sampling = Sampling(stop=["x"])
    kwargs = sampling_kwargs(sampling)
    kwargs["stop"].append("y")
    assert sampling.stop == ["x"]


def test_unset_parameters_are_left_to_vllm() -> None:
    # vLLM then takes the model's generation config, else its own defaults.
    assert sampling_kwargs(Sampling()) == {"max_tokens": 256, "stop": []}


@pytest.mark.parametrize(
    ("vllm_reason", "expected"),
    [(None, None), ("stop", "stop"), ("length", "length"), ("abort", "cancelled")],
)
def test_finish_reason_mapping(vllm_reason: str | None, expected: str | None) -> None:
    assert finish_reason(vllm_reason) == expected


@pytest.mark.parametrize("vllm_reason", ["error", "something_new", ""])
def test_unknown_finish_reason_is_error(vllm_reason: str) -> None:
    assert finish_reason(vllm_reason) == "error"


async def test_engine_refuses_work_before_start() -> None:
    engine = VllmEngine(
        model_name="m",
        model_path="/nowhere",
        tensor_parallel_size=1,
        max_seqs=2,
        gpu_memory_utilization=0.9,
        max_model_len=None,
    )
    with pytest.raises(EngineError):
        await engine.check_health()
    await engine.abort("not-running")  # a no-op, never an AttributeError
    await engine.stop()
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(EngineError, match="vLLM"):
            await engine.start()


def _cuda_and_vllm() -> bool:
    """Both vLLM and a CUDA device; torch is imported only when vLLM is installed."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_and_vllm(), reason="needs vLLM and a CUDA device")
def test_vllm_accepts_axon_sampling_params() -> None:
    vllm = pytest.importorskip("vllm")
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    sampling = Sampling(max_tokens=8, temperature=0.0, top_p=0.9, top_k=0, stop=["\n"], seed=1)
    params = SamplingParams(**sampling_kwargs(sampling), output_kind=RequestOutputKind.DELTA)
    assert params.max_tokens == 8
    assert params.temperature == 0.0
    assert params.stop == ["\n"]
    assert params.seed == 1
    assert params.top_k in (-1, 0)  # disabled, however this vLLM spells it
    assert vllm.__version__
