"""hicache: a serving engine whose radix prefix cache reaches from device memory to host memory and
external storage, and never changes an answer."""

from hicache.config import EngineConfig
from hicache.engine.engine import Engine, GenerationResult
from hicache.scheduler.request import SamplingParams

__all__ = ["Engine", "EngineConfig", "GenerationResult", "SamplingParams"]
__version__ = "0.1.0"
