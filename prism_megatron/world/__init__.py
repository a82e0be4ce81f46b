"""Pure rank arithmetic of the virtual world: groups, coordinates, nodes and roles."""

from prism_megatron.world.virtual_world import AXES, Dim, Role, VirtualWorld

__all__ = ["AXES", "Dim", "Role", "VirtualWorld"]
