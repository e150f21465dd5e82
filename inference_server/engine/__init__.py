"""The engine: requests, scheduler, KV block manager, model runner, async front."""
