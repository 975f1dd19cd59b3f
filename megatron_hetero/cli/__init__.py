"""The user commands behind tools/plan_layout.py (plan.py) and tools/verify_layout.py (verify.py)."""
