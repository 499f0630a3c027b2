"""The only code that moves KV bytes: the controller, its copy stream, the storage I/O threads and the copy kernels."""
