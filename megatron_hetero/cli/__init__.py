"""The `megatron-hetero` command (main.py) and the commands of its own: plan.py (`megatron-hetero plan`,
tools/plan_layout.py) and verify.py (`megatron-hetero verify`, tools/verify_layout.py)."""
