"""Forward/backward schedules of one global batch, per placement (see each module)."""

from megatron_hetero.schedules.colocated import colocated_step
from megatron_hetero.schedules.non_colocated import non_colocated_step
from megatron_hetero.schedules.routing import route_media

__all__ = ["colocated_step", "non_colocated_step", "route_media"]
