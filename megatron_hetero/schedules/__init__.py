"""Forward/backward schedules of one global batch, per placement: colocated.py, non_colocated.py
(over the stages of stages.py, their ops ordered by pipeline.py and colocated_order.py and run by
pipeline.execute). forward_backward.py is megatron.training's forward-backward function: it picks
one per step."""
