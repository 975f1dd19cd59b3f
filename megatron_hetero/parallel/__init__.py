"""Process groups per module, the run description built from them, megatron-core's globals pointed at a module."""
