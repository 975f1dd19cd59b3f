"""Forward/backward schedules of one global batch, per placement: colocated.py, non_colocated.py
(over the stages of stages.py, in the 1F1B order of pipeline.py). runtime/forward_backward.py picks
one per step."""
