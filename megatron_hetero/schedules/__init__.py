"""One training step, in one place: its context and parts (step.py: the script's calls captured and
replayed, the boundary plans, each module's last backward), the forward/backward schedules of one
global batch per placement, colocated.py and non_colocated.py (over the stages of stages.py, their ops
ordered by pipeline.py and colocated_order.py and run by pipeline.execute), and forward_backward.py,
megatron.training's forward-backward function, which picks one per step."""
