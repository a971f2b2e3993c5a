"""tidal: asynchronous, off-policy RL for LLMs (vLLM actors, ZeroMQ broker, Accelerate learner)."""

__version__ = "0.1.0"
