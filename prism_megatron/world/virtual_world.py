"""The virtual world: which virtual rank belongs to which Megatron process group, and which role.

Owns the pure rank arithmetic of a virtual Megatron-core job of ``world_size`` ranks: the
parallel sizes (tp, pp, cp, ep, etp, dp, expert_dp), their validation, every process group
megatron-core's ``initialize_model_parallel`` builds (as global-rank tuples, in megatron's creation
order), a rank's coordinates, its node, and its *role* (the coordinates that make ranks run
different programs). No torch.distributed, no global state: everything hangs off one frozen
``VirtualWorld`` value.

The rank lists are megatron's, not a re-derivation: they come from megatron-core's own
``RankGenerator`` (one decoder and one expert generator, configured exactly as
``initialize_model_parallel`` configures them). Calling ``RankGenerator.get_ranks`` takes ~0.2 s per
dim at 65,536 ranks (pure Python over every rank), so we call megatron's
``generate_masked_orthogonal_rank_groups`` once per axis on a shortened world to get that axis's
additive part of its formula and combine the parts with numpy (see ``_megatron_group_array``).
Groups of a dim are computed on first use and cached; construction is O(1) and never imports
megatron (importing megatron.core costs ~3 s).

Known limits:
- Only megatron's default embedding / position-embedding rank choice (first and last pipeline
  stage / first stage); custom ``get_embedding_ranks`` callables are not modelled.
- Groups megatron builds only under options (hierarchical CP, hybrid DP-CP, partial distributed
  optimizer instances, the all-gather twin of dp_cp, the gloo twins) are not described here.
- ``vpp`` is validated (it needs pp > 1) but does not change any group.
- Ranks beyond 2**31 are not supported (rank arrays are int32 to halve memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from numbers import Integral
from typing import Any, Iterable

import numpy as np

__all__ = ["AXES", "Dim", "Role", "VirtualWorld"]


class Dim(StrEnum):
    """A kind of process group megatron-core builds; the order is the tie-break of ``dim_of``."""

    TP = "tp"
    PP = "pp"
    DP = "dp"
    CP = "cp"
    EP = "ep"
    ETP = "etp"
    EXPERT_DP = "expert_dp"
    DP_CP = "dp_cp"
    TP_PP = "tp_pp"  # megatron's "model parallel" group: tp x pp, without cp
    TP_DP = "tp_dp"
    TP_DP_CP = "tp_dp_cp"
    TP_CP = "tp_cp"
    TP_EP = "tp_ep"
    TP_EP_PP = "tp_ep_pp"
    EMBEDDING = "embedding"
    POSITION_EMBEDDING = "position_embedding"


AXES: tuple[Dim, ...] = tuple(Dim)

_DECODER = "decoder"
_EXPERT = "expert"

# Which of megatron's two RankGenerators, and which token, builds each dim; copied from
# initialize_model_parallel (megatron-core 0.16.1). The embedding dims are derived from pp groups.
_SOURCE: dict[Dim, tuple[str, str]] = {
    Dim.TP: (_DECODER, "tp"),
    Dim.PP: (_DECODER, "pp"),
    Dim.DP: (_DECODER, "dp"),
    Dim.CP: (_DECODER, "cp"),
    Dim.DP_CP: (_DECODER, "dp-cp"),
    Dim.TP_PP: (_DECODER, "tp-pp"),
    Dim.TP_DP: (_DECODER, "tp-dp"),
    Dim.TP_DP_CP: (_DECODER, "tp-dp-cp"),
    Dim.TP_CP: (_DECODER, "tp-cp"),
    Dim.EP: (_EXPERT, "ep"),
    Dim.ETP: (_EXPERT, "tp"),
    Dim.EXPERT_DP: (_EXPERT, "dp"),
    Dim.TP_EP: (_EXPERT, "tp-ep"),
    Dim.TP_EP_PP: (_EXPERT, "tp-ep-pp"),
}

# Tokens megatron's RankGenerator knows; any permutation (size-1 tokens may be left out).
_ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
MAX_WORLD_SIZE = 1 << 20
"""The largest virtual world accepted (1,048,576 ranks): rank tables are arrays of N entries, so a
mistyped size (2**30) would otherwise run until memory is gone instead of failing at once."""

# coords() keys -> the dim whose in-group index is that coordinate.
_COORD_DIMS = {
    "tp": Dim.TP,
    "cp": Dim.CP,
    "dp": Dim.DP,
    "pp": Dim.PP,
    "ep": Dim.EP,
    "etp": Dim.ETP,
    "expert_dp": Dim.EXPERT_DP,
}


@dataclass(frozen=True, order=True)
class Role:
    """The coordinates that make ranks run different programs; data-parallel replicas share one.

    Sorting is by pipeline stage first, so ``roles()`` walks the pipeline front to back.
    """

    #: pipeline stage (index in the pp group)
    pp: int
    #: index in the tensor-parallel group (attention / dense layers)
    tp: int
    #: index in the context-parallel group
    cp: int
    #: index in the expert-parallel group (which experts the rank holds)
    ep: int
    #: index in the expert-tensor-parallel group
    etp: int


@dataclass(frozen=True, kw_only=True)
class VirtualWorld:
    """A virtual Megatron-core world of ``world_size`` ranks and its parallel layout."""

    #: number of virtual ranks (GPUs) of the emulated job
    world_size: int
    #: tensor-parallel size (attention / dense layers)
    tp: int = 1
    #: pipeline-parallel size (number of stages)
    pp: int = 1
    #: context-parallel size (sequence split of attention)
    cp: int = 1
    #: expert-parallel size (MoE experts split across ranks)
    ep: int = 1
    #: expert tensor-parallel size; None means equal to tp, as megatron does
    etp: int | None = None
    #: megatron rank order, fastest-varying first, e.g. "tp-cp-ep-dp-pp" or "tp-cp-ep-pp-dp"
    order: str = "tp-cp-ep-dp-pp"
    #: GPUs per node; consecutive ranks fill a node (megatron assumes adjacent ranks share a box)
    gpus_per_node: int = 8
    #: virtual (interleaved) pipeline size; only validated (needs pp > 1), changes no group
    vpp: int | None = None
    # Lazily computed group tables, keyed by name. Mutating a dict keeps the dataclass frozen,
    # hashable and cheap to construct; compare=False keeps it out of == and hash.
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError("invalid virtual world: " + "; ".join(problems))

    # ------------------------------------------------------------------ validation

    def _problems(self) -> list[str]:
        """Every user error in the configuration, each with what, what is expected, and the fix."""
        sizes = {
            "world_size": self.world_size,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "ep": self.ep,
            "gpus_per_node": self.gpus_per_node,
        }
        for name in ("etp", "vpp"):
            if getattr(self, name) is not None:
                sizes[name] = getattr(self, name)
        bad = [f"{k}={v!r}" for k, v in sizes.items() if not _is_positive_int(v)]
        if bad:
            # Divisibility of non-integers or zero means nothing; report only this.
            return [f"sizes must be positive integers, got {', '.join(bad)}; set each to 1 or more"]
        if self.world_size > MAX_WORLD_SIZE:
            return [f"world_size {self.world_size} is more than the {MAX_WORLD_SIZE} ranks this emulator "
                    "models; choose a smaller virtual world"]

        problems = []
        n = self.world_size
        if n % (self.tp * self.pp * self.cp):
            problems.append(
                f"virtual world {n} is not divisible by tp({self.tp}) * pp({self.pp}) * "
                f"cp({self.cp}) = {self.tp * self.pp * self.cp}; "
                "choose sizes whose product divides the world size"
            )
        etp_note = " (etp defaults to tp)" if self.etp is None else ""
        if n % (self._etp * self.ep * self.pp):
            problems.append(
                f"virtual world {n} is not divisible by etp({self._etp}){etp_note} * "
                f"ep({self.ep}) * pp({self.pp}) = {self._etp * self.ep * self.pp}; "
                "choose expert sizes whose product divides the world size"
            )
        divisible = not problems
        if self.vpp is not None and self.pp <= 1:
            problems.append(
                f"vpp({self.vpp}) interleaves pipeline stages but pp({self.pp}) is not > 1; "
                "set pp > 1 or leave vpp unset"
            )
        problems += self._order_problems(sizes_ok=divisible)
        return problems

    def _order_problems(self, *, sizes_ok: bool) -> list[str]:
        expected = (
            f"expected a '-'-joined order of {', '.join(_ORDER_TOKENS)}, e.g. 'tp-cp-ep-dp-pp'"
        )
        if not isinstance(self.order, str):
            return [f"order must be a string, got {self.order!r}; {expected}"]
        tokens = self.order.split("-")
        unknown = [t for t in tokens if t not in _ORDER_TOKENS]
        repeated = sorted({t for t in tokens if tokens.count(t) > 1})
        problems = []
        if unknown:
            problems.append(f"order {self.order!r} has unknown token(s) {unknown}; {expected}")
        if repeated:
            problems.append(f"order {self.order!r} repeats {repeated}; {expected}, each once")
        if unknown or repeated or not sizes_ok:
            return problems
        decoder, expert = self._generator_sizes()
        missing = [
            f"{t}({max(decoder[t], expert[t])})"
            for t in _ORDER_TOKENS
            if t not in tokens and max(decoder[t], expert[t]) > 1
        ]
        if missing:
            problems.append(
                f"order {self.order!r} leaves out {', '.join(missing)}; megatron may only leave "
                "out sizes of 1: add them to the order"
            )
            return problems
        if self.pp > 1 and not self.order.endswith("pp") and self.dp != self.expert_dp:
            # initialize_model_parallel asserts this: attention and MoE layers share the
            # data-parallel replicas when pp is not the slowest axis.
            problems.append(
                f"with order {self.order!r} (pp not last) and pp({self.pp}) > 1 megatron needs "
                f"dp = world/(tp*pp*cp) = {self.dp} to equal expert_dp = world/(etp*ep*pp) = "
                f"{self.expert_dp}; make tp({self.tp}) * cp({self.cp}) equal "
                f"etp({self._etp}) * ep({self.ep}), or put pp last in the order"
            )
        elif self.pp > 1:
            # initialize_model_parallel also asserts both generators give the same pp groups,
            # i.e. the same product of the sizes that vary faster than pp.
            before_pp = tokens[: tokens.index("pp")]
            dec_step = math.prod(decoder[t] for t in before_pp)
            exp_step = math.prod(expert[t] for t in before_pp)
            if dec_step != exp_step:
                problems.append(
                    f"with order {self.order!r} the pipeline groups of the dense part (rank step "
                    f"{dec_step}) and the expert part (rank step {exp_step}) differ, which "
                    "megatron rejects; make the product of the sizes before pp equal for both "
                    "(tp, cp, dp vs etp, ep, expert_dp), or put pp last in the order"
                )
        return problems

    def _generator_sizes(self) -> tuple[dict[str, int], dict[str, int]]:
        """Sizes of megatron's decoder and expert RankGenerators, as initialize_model_parallel
        sets them."""
        decoder = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        expert = {"tp": self._etp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}
        return decoder, expert

    # ------------------------------------------------------------------ sizes

    @property
    def _etp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense part: world / (tp * pp * cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert part: world / (etp * ep * pp)."""
        return self.world_size // (self._etp * self.ep * self.pp)

    @property
    def num_nodes(self) -> int:
        """Nodes the world occupies; a last, partly filled node counts."""
        return -(-self.world_size // self.gpus_per_node)

    # ------------------------------------------------------------------ per rank

    def _check_rank(self, rank: int) -> int:
        if not (isinstance(rank, Integral) and 0 <= rank < self.world_size):
            raise ValueError(
                f"rank {rank!r} is not in the virtual world; expected 0 <= rank < {self.world_size}"
            )
        return int(rank)

    def node(self, rank: int) -> int:
        """The node hosting ``rank``."""
        return self._check_rank(rank) // self.gpus_per_node

    def local_rank(self, rank: int) -> int:
        """``rank``'s GPU index inside its node."""
        return self._check_rank(rank) % self.gpus_per_node

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index inside its tp, cp, dp, pp (dense) and ep, etp, expert_dp groups."""
        rank = self._check_rank(rank)
        return {key: int(self._lookup(dim)[2][rank]) for key, dim in _COORD_DIMS.items()}

    def role(self, rank: int) -> Role:
        """``rank``'s role: its coordinates other than the data-parallel index."""
        c = self.coords(rank)
        return Role(pp=c["pp"], tp=c["tp"], cp=c["cp"], ep=c["ep"], etp=c["etp"])

    # ------------------------------------------------------------------ roles

    def _role_table(self) -> tuple[list[Role], np.ndarray, dict[Role, int]]:
        if "roles" not in self._cache:
            columns = [self._lookup(_COORD_DIMS[f])[2] for f in ("pp", "tp", "cp", "ep", "etp")]
            radix = (self.pp, self.tp, self.cp, self.ep, self._etp)
            # One key per rank, Role's field order most significant first: sorted keys are sorted
            # roles, and a 1-D unique is ~10x faster than np.unique(axis=0).
            keys, role_of_rank = np.unique(
                np.ravel_multi_index(columns, radix), return_inverse=True
            )
            roles = [Role(*map(int, c)) for c in zip(*np.unravel_index(keys, radix))]
            index = {role: i for i, role in enumerate(roles)}
            self._cache["roles"] = (roles, role_of_rank.reshape(-1), index)
        return self._cache["roles"]

    def roles(self) -> list[Role]:
        """All distinct roles, sorted (pipeline stage first)."""
        return list(self._role_table()[0])

    def role_members(self, role: Role) -> list[int]:
        """The ranks that have ``role``, ascending."""
        _, role_of_rank, index = self._role_table()
        if role not in index:
            raise ValueError(f"{role} is not a role of this world; pick one from roles()")
        return np.flatnonzero(role_of_rank == index[role]).tolist()

    def representative(self, role: Role) -> int:
        """The smallest rank of ``role``: the rank a slice of that role runs as."""
        return self.role_members(role)[0]

    def stage_rank(self, stage: int) -> int:
        """The lowest virtual rank of pipeline stage ``stage``."""
        for rank in self.group(0, Dim.PP) if self.pp > 1 else (0,):
            if self.coords(rank)["pp"] == stage:
                return int(rank)
        raise ValueError(f"no rank of pipeline stage {stage}: expected 0 to {self.pp - 1}")

    # ------------------------------------------------------------------ groups

    def group(self, rank: int, dim: Dim | str) -> tuple[int, ...]:
        """Members of ``rank``'s group of ``dim``, global ranks in megatron's order.

        Empty for an embedding dim when ``rank`` is on no embedding stage (megatron leaves that
        rank's embedding group unset).
        """
        rank = self._check_rank(rank)
        table, group_of_rank, _ = self._lookup(_as_dim(dim))
        g = group_of_rank[rank]
        return () if g < 0 else tuple(table[g].tolist())

    def groups(self, dim: Dim | str) -> list[tuple[int, ...]]:
        """All groups of ``dim``, in the order megatron's initialize_model_parallel creates them."""
        return [tuple(row) for row in self._lookup(_as_dim(dim))[0].tolist()]

    def dim_of(self, members: Iterable[int]) -> Dim | None:
        """Which dim a group with these members is (first match in ``Dim`` order), else None.

        Order of ``members`` does not matter: torch's new_group sorts ranks, and megatron's own
        lists are ascending anyway.
        """
        ranks = tuple(sorted(int(r) for r in members))
        if not ranks or not 0 <= ranks[0] < self.world_size:
            return None
        for dim in Dim:
            if self.group(ranks[0], dim) == ranks:
                return dim
        return None

    def _lookup(self, dim: Dim) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(groups [num_groups, size], rank -> group index or -1, rank -> index in its group)."""
        if dim not in self._cache:
            table = self._group_array(dim)
            group_of_rank = np.full(self.world_size, -1, dtype=np.int32)
            index_in_group = np.full(self.world_size, -1, dtype=np.int32)
            num_groups, size = table.shape
            group_of_rank[table.ravel()] = np.repeat(np.arange(num_groups, dtype=np.int32), size)
            index_in_group[table.ravel()] = np.tile(np.arange(size, dtype=np.int32), num_groups)
            self._cache[dim] = (table, group_of_rank, index_in_group)
        return self._cache[dim]

    def _group_array(self, dim: Dim) -> np.ndarray:
        if dim in (Dim.EMBEDDING, Dim.POSITION_EMBEDDING):
            from megatron.core.parallel_state import (
                default_embedding_ranks,
                default_position_embedding_ranks,
            )

            pick = {
                Dim.EMBEDDING: default_embedding_ranks,
                Dim.POSITION_EMBEDDING: default_position_embedding_ranks,
            }[dim]
            # initialize_model_parallel calls pick(pp_ranks) per pp group; megatron's defaults pick
            # by position in the group, so one call on the positions gives the columns for all.
            columns = pick(list(range(self.pp)))
            return self._lookup(Dim.PP)[0][:, columns]
        which, token = _SOURCE[dim]
        axis_cache = self._cache.setdefault("axis_offsets", {})
        return _megatron_group_array(self._generators()[which], token, axis_cache)

    def _generators(self) -> dict[str, Any]:
        """megatron's two RankGenerators, built exactly as initialize_model_parallel builds them."""
        if "generators" not in self._cache:
            # Imported here: importing megatron.core costs seconds, construction must stay O(1).
            from megatron.core.parallel_state import RankGenerator

            decoder, expert = self._generator_sizes()
            self._cache["generators"] = {
                _DECODER: RankGenerator(**decoder, order=self.order, rank_offset=0),
                _EXPERT: RankGenerator(**expert, order=self.order, rank_offset=0),
            }
        return self._cache["generators"]


def _megatron_group_array(
    generator: Any, token: str, axis_cache: dict[tuple[int, int], np.ndarray]
) -> np.ndarray:
    """``generator.get_ranks(token)`` as a [num_groups, size] int32 array, without O(N) Python.

    megatron's generate_masked_orthogonal_rank_groups computes each rank as a sum over the order's
    axes of (digit * stride), the group's digits enumerated first-axis-fastest for both the
    members (masked axes) and the groups (unmasked axes). So we ask megatron for each axis's
    contribution alone (its one-axis mask on a world one group long: group 0 only, O(axis size)
    Python, cached) and add them up in that same digit order with numpy.
    tests/test_world.py checks the result against initialize_model_parallel itself.
    """
    from megatron.core.parallel_state import generate_masked_orthogonal_rank_groups

    assert generator.rank_offset == 0, "initialize_model_parallel uses rank_offset 0"
    mask = generator.get_mask(generator.order, token)
    sizes = generator.ordered_size

    def axis_offsets(k: int) -> np.ndarray:
        # An axis's part depends only on its size and stride, so both generators share it.
        key = (sizes[k], math.prod(sizes[:k]))
        if key not in axis_cache:
            one_axis = [i == k for i in range(len(sizes))]
            ranks = generate_masked_orthogonal_rank_groups(sizes[k], sizes, one_axis)[0]
            axis_cache[key] = np.asarray(ranks, dtype=np.int32)
        return axis_cache[key]

    def offsets(axes: list[int]) -> np.ndarray:
        out = np.zeros(1, dtype=np.int32)
        for k in axes:  # later axes vary slower, so they go on the outside
            out = np.add.outer(axis_offsets(k), out).ravel()
        return out

    members = offsets([k for k, m in enumerate(mask) if m])
    bases = offsets([k for k, m in enumerate(mask) if not m])
    return np.add.outer(bases, members)


def _as_dim(dim: Dim | str) -> Dim:
    try:
        return Dim(dim)
    except ValueError:
        raise ValueError(
            f"unknown group dim {dim!r}; expected one of {', '.join(d.value for d in Dim)}"
        ) from None


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and value > 0
