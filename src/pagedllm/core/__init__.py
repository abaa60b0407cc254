"""Pure-Python engine core: block pool, KV cache manager, scheduler. No torch here."""
