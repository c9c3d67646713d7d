"""Inference engines behind one interface, chosen by `AXON_ENGINE`."""

from services.worker.engines.base import (
    Engine,
    EngineDied,
    EngineError,
    EngineOutput,
    EngineStopped,
    GenerationRequest,
    InvalidPrompt,
    Resume,
)

__all__ = [
    "Engine",
    "EngineDied",
    "EngineError",
    "EngineOutput",
    "EngineStopped",
    "GenerationRequest",
    "InvalidPrompt",
    "Resume",
]
