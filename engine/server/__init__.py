"""The gRPC daemon: GenerationService and CacheAdminService over an Engine."""
