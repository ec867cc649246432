"""What the engine adapters share: the registry of adapters found by entry point (`registry`), the
attach banner, FSDP detection, and per-rank checkpoint files."""
from dad_integrations.engines.registry import EngineAdapter, get_engine, registered_engines

__all__ = ["EngineAdapter", "get_engine", "registered_engines"]
