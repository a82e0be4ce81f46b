"""Cluster descriptions: nodes, links, network, GPU memory and peak compute (config, pure).

Shipped in `configs/cluster/`: `dgx_h100` (NVLink4, 8x400 Gb/s InfiniBand, NVLink SHARP),
`dgx_a100` (NVLink3, 8x200 Gb/s), `h200x2` (this project's 2x H200 machine, figures from its
calibration) and `cpu_host` (gloo over loopback on this VM). Bandwidths are per GPU and
unidirectional, in GB/s (1e9 bytes/s); NIC speeds in Gb/s as vendors quote them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import yaml

from prism_megatron.comm.cost import Calibration, CostModel
from prism_megatron.config.schema import ConfigError
from prism_megatron.resources import CONFIG_DIR

CLUSTER_DIR = CONFIG_DIR / "cluster"


@dataclass(kw_only=True)
class ClusterConfig:
    """A homogeneous cluster of nodes on a rail-optimized fat-tree."""

    name: str = "dgx_h100"
    """Name shown in reports."""

    gpu: str = "H100-SXM-80GB"
    """Device type."""

    gpus_per_node: int = 8
    """Devices per node (one NIC each, one rail each)."""

    gpu_memory_bytes: int = 80 * 1024**3
    """Memory capacity of one device."""

    peak_tflops: float = 989.0
    """Dense bf16 peak of one device (TFLOP/s), the MFU denominator."""

    nvlink_GBps: float = 450.0
    """Intra-node bandwidth per device, one direction (NVLink4: 900 GB/s bidirectional)."""

    nvlink_domain: int = 8
    """Devices sharing one NVLink domain (a node, or an NVL72 rack)."""

    nvls: bool = True
    """NVLink SHARP (in-switch reduction) available inside the NVLink domain."""

    nic_Gbps: float = 400.0
    """NIC speed per device (rail), Gb/s."""

    nodes_per_leaf: int = 32
    """Nodes under one leaf switch per rail; beyond that traffic crosses the spine."""

    oversubscription: float = 1.0
    """Spine oversubscription (1: non-blocking)."""

    switch_latency_us: float = 0.3
    """Latency of one switch hop."""

    def __post_init__(self) -> None:
        for f in ("gpus_per_node", "nvlink_domain", "nodes_per_leaf"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ConfigError(f"cluster.{f}={getattr(self, f)!r}: expected a positive integer")
        for f in ("gpu_memory_bytes", "peak_tflops", "nvlink_GBps", "nic_Gbps", "oversubscription",
                  "switch_latency_us"):
            value = getattr(self, f)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            low_ok = number and (value >= 0 if f == "switch_latency_us" else value > 0)
            if not (low_ok and value < math.inf):  # NaN fails both
                raise ConfigError(f"cluster.{f}={value!r}: expected a finite number > 0"
                                  f"{' (or 0)' if f == 'switch_latency_us' else ''}")
        if not isinstance(self.nvls, bool):
            raise ConfigError(f"cluster.nvls={self.nvls!r}: expected true or false")
        for f in ("name", "gpu"):
            if not isinstance(getattr(self, f), str):
                raise ConfigError(f"cluster.{f}={getattr(self, f)!r}: expected a string")
        if self.oversubscription < 1:
            raise ConfigError(f"cluster.oversubscription={self.oversubscription}: expected >= 1 "
                              "(1 is non-blocking, 2 means half the bandwidth through the spine)")

    def cost_model(self, calibration: Optional[Calibration] = None) -> CostModel:
        return CostModel(nvlink_Bps=self.nvlink_GBps * 1e9, net_Bps=self.nic_Gbps / 8 * 1e9,
                         nodes_per_leaf=self.nodes_per_leaf, oversubscription=self.oversubscription,
                         switch_latency_us=self.switch_latency_us, nvls=self.nvls,
                         calibration=calibration)


def load_cluster(spec: str, overrides: Optional[dict] = None) -> ClusterConfig:
    """A shipped cluster by name (`dgx_h100`) or a YAML file, with `overrides` on top."""
    path = Path(spec)
    if not path.suffix:
        path = CLUSTER_DIR / f"{spec}.yaml"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml")))
        raise ConfigError(f"cluster {spec!r} not found; use one of {shipped} or a YAML file path")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"cluster file {path} is not readable YAML{where}: {problem}; fix it (UTF-8, "
                          "spaces not tabs) or use a shipped cluster") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {path} holds a {type(data).__name__}, expected a mapping of "
                          f"cluster keys ({', '.join(f.name for f in fields(ClusterConfig))})")
    data.update(overrides or {})
    known = {f.name for f in fields(ClusterConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown cluster key(s) {unknown} in {path}; known: {', '.join(sorted(known))}")
    return ClusterConfig(**data)


def load_calibration(path: Optional[str]) -> Optional[Calibration]:
    """The calibration file `path` (None: none), or a one-line ConfigError."""
    if not path:
        return None
    try:
        return Calibration.from_json(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"calibration={path}: not a readable calibration file ({err}); write one with "
                          "`prism-megatron calibrate`") from None
