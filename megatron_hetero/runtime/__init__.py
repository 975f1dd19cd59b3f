"""This process's share of a heterogeneous run inside megatron.training: the model Megatron trains
(model.py) and its parts wrapped under each module's groups (wrap.py), gradient finalize (grads.py),
the optimizer, checkpoint checks, phase timers, the watchdog and failure reports."""
