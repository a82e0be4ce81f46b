"""Which roles to run as slices: classes of roles believed symmetric, and two members of each.

A role is (pipeline stage, tensor/context/expert coordinates). Ranks of one role run the same program
by construction; different roles may too, and that is what makes a capture of 8192 ranks cheap:

- tensor symmetry: the tensor, context and expert coordinates of a dense model change which shard a
  rank holds, not what it runs;
- stage symmetry: without interleaving, a stage runs `min(pp - stage - 1, microbatches)` warm-up
  forwards and then 1F1B; stages with the same warm-up count that are neither first nor last (which
  hold the embedding and the loss) hold the same number of layers and run the same schedule.

So a class is every role whose stage has the same (first, last, warm-up) signature; with interleaving
(virtual stages) every stage is its own class. A belief is not a fact: each class with more than one
role gets two members captured, chosen to differ in as many coordinates as possible, and is inferred
from them only if their structure hashes agree (capture/run.py); otherwise all of it is captured.
MoE models are planned the same way: token counts are part of the hash, so an imbalance that makes
expert ranks differ shows up as a failed verification, never as a wrong inference.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from prism_megatron.world import Role, VirtualWorld


@dataclass(frozen=True)
class RoleClass:
    """Roles believed to run the same program; `key` says why."""

    key: str
    roles: tuple[Role, ...]

    @property
    def probes(self) -> tuple[Role, ...]:
        """The members captured to test the belief: the first, and the one most unlike it."""
        first = self.roles[0]
        if len(self.roles) == 1:
            return (first,)
        a = astuple(first)
        second = max(self.roles[1:], key=lambda r: (sum(x != y for x, y in zip(astuple(r), a)),
                                                    astuple(r)))
        return first, second


def stage_key(world: VirtualWorld, stage: int, microbatches: int) -> str:
    """What a stage's program depends on besides its layers (equal for every stage)."""
    if world.vpp:
        return f"stage{stage}"
    parts = []
    if stage == 0:
        parts.append("first")
    if stage == world.pp - 1:
        parts.append("last")
    warmup = min(world.pp - stage - 1, microbatches)
    return "+".join(parts + [f"warmup{warmup}"])


def plan_classes(world: VirtualWorld, microbatches: int) -> list[RoleClass]:
    """The roles of `world` grouped into classes believed symmetric, in pipeline order."""
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches}: expected at least 1 per iteration")
    groups: dict[str, list[Role]] = {}
    for role in world.roles():  # sorted by stage first
        groups.setdefault(stage_key(world, role.pp, microbatches), []).append(role)
    return [RoleClass(key, tuple(roles)) for key, roles in groups.items()]
