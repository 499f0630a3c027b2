"""The scheduler process: Engine (the in-process Python API), the scheduler, the model runner,
models and attention layers, and the cache glue (tree_factory, hicache_setup, cache_admin,
tenant_cache). process.py is the split daemon's entry point; a script runs Engine in-process."""
