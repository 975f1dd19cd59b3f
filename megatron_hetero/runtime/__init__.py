"""This process's share of a heterogeneous run inside megatron.training: its modules and groups
(context.py), the model and optimizer Megatron trains (model.py, optimizer.py), one step's context
(step.py) and forward-backward function (forward_backward.py), checkpoint checks and the watchdog."""
