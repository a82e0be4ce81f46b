"""The config schema: one dataclass per component, the single source of every config name.

These are omegaconf *structured configs*: `prism_megatron.config.load_config` merges YAML files and
`key=value` overrides onto them and then instantiates the dataclasses, which runs `__post_init__`
validation. Each field carries a docstring (the string literal under it); CLI help and the Megatron-style
`--prism-*` flags are generated from those docstrings (see `config/docs.py`, `config/flags.py`).

Validation raises `ConfigError` (a `ValueError`) whose message says what was wrong, what was expected
and how to fix it; the CLI prints that one line and exits with status 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from prism_megatron.config.base import ConfigError, require_choice
from prism_megatron.config.base import require_positive as _require_positive
from prism_megatron.config.model import DTYPES, ModelConfig

GHOST_POLICIES = ("mirror", "zeros", "random")
CLOCKS = ("virtual", "realtime")
EXECUTIONS = ("auto", "real", "fake")
DEVICES = ("auto", "cpu", "cuda")
GRANULARITIES = ("module", "aten")
TIMINGS = ("two-pass", "single-pass")
SELECTIONS = ("last", "median", "node-median")


@dataclass(kw_only=True)
class EmulationConfig:
    """How the virtual world is emulated: its size, which virtual ranks are real, ghost data."""

    virtual_world_size: Optional[int] = None
    """Number of ranks of the emulated job (N). None: no emulation, the physical world as launched."""

    sandbox_ranks: List[int] = field(default_factory=list)
    """Virtual rank played by each physical process, in physical-rank order; empty: ranks 0..P-1."""

    ghost_policy: str = "mirror"
    """Data a ghost contributes: mirror (a real member's contribution), zeros, or random (seeded)."""

    ghost_seed: int = 1234
    """Seed of the random ghost policy; identical on every real member, so results agree."""

    gpus_per_node: int = 8
    """GPUs per node of the emulated cluster (placement of virtual ranks on nodes)."""

    clock: str = "virtual"
    """virtual: nothing is slept, the iteration time is computed by the replay; realtime: the sandbox's
    communication is held as the replay says (`delay_plan`, emulate/holds.py: until the later of its
    own and its ghosts' arrival plus the transfer; a sleep on CPU, a spinning kernel on the GPU's
    stream), so it runs at the production duty cycle."""

    delay_plan: Optional[str] = None
    """JSON of the holds per communication operation of an iteration (clock=realtime);
    `prism-megatron emulate --clock realtime` writes it."""

    execution: str = "auto"
    """real: the sandbox's kernels run on this machine's device; fake: tensors have shapes and dtypes
    but no data (torch FakeTensorMode), compute durations come from the kernel-cost model of
    `target_gpu` and memory from a model of the CUDA caching allocator; auto: real where this device
    can hold the rank's model state, fake otherwise (the run says which it took)."""

    target_gpu: str = "h200"
    """GPU a fake run predicts: h200 or h100 (calibrated on that GPU, shipped), a100 (roofline from
    its documented peaks), or a file written by `prism-megatron calibrate --kernels`."""

    stop_after: int = 0
    """End the training script from the hooks once this many iterations have run (the N-th optimizer
    step done; at the start of the next forward-backward pass, which never runs), whatever its own
    count (Megatron-LM's `--train-iters`); 0: the script's own count. Capture slices and emulation
    sandboxes of a script given after `--` stop after `SCRIPT_ITERATIONS` unless this is set."""

    peer_timeout_s: float = 60.0
    """Longest a sandbox waits for another sandbox in one communication operation (or building a
    group) before it fails with an error naming that peer (a peer stopped, hung or died); the
    script's own process-group timeout wins where it is shorter."""

    def __post_init__(self) -> None:
        _require_positive("emulation", virtual_world_size=self.virtual_world_size,
                          gpus_per_node=self.gpus_per_node)
        if not isinstance(self.peer_timeout_s, (int, float)) or not 0 < self.peer_timeout_s < float("inf"):
            raise ConfigError(f"emulation.peer_timeout_s={self.peer_timeout_s!r}: expected a finite number "
                              "of seconds > 0 (60 by default)")
        if not isinstance(self.stop_after, int) or self.stop_after < 0:
            raise ConfigError(f"emulation.stop_after={self.stop_after!r}: expected an iteration count "
                              ">= 0 (0: the script's own count)")
        if self.execution not in EXECUTIONS:
            raise ConfigError(f"emulation.execution={self.execution!r} is unknown; expected one of "
                              f"{', '.join(EXECUTIONS)}")
        if self.clock not in CLOCKS:
            raise ConfigError(f"emulation.clock={self.clock!r} is unknown; expected one of "
                              f"{', '.join(CLOCKS)}")
        if self.ghost_policy not in GHOST_POLICIES:
            raise ConfigError(
                f"emulation.ghost_policy={self.ghost_policy!r} is unknown; expected one of "
                f"{', '.join(GHOST_POLICIES)}")
        ranks = list(self.sandbox_ranks)
        if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
            raise ConfigError(f"emulation.sandbox_ranks={ranks}: expected distinct ranks >= 0")
        if self.virtual_world_size is not None:
            out = [r for r in ranks if r >= self.virtual_world_size]
            if out:
                raise ConfigError(
                    f"sandbox rank(s) {out} >= virtual world size {self.virtual_world_size}; "
                    f"choose ranks in 0..{self.virtual_world_size - 1}")


@dataclass(kw_only=True)
class ParallelConfig:
    """Megatron parallel sizes; dp is derived: world / (tp * pp * cp)."""

    tp: int = 1
    """Tensor model parallel size (--tensor-model-parallel-size)."""

    pp: int = 1
    """Pipeline model parallel size (--pipeline-model-parallel-size)."""

    cp: int = 1
    """Context parallel size (--context-parallel-size)."""

    ep: int = 1
    """Expert model parallel size (--expert-model-parallel-size)."""

    etp: Optional[int] = None
    """Expert tensor parallel size (--expert-tensor-parallel-size); None: equal to tp."""

    vpp: Optional[int] = None
    """Virtual pipeline stages per rank, interleaved 1F1B (--num-virtual-stages-per-pipeline-rank)."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism inside the tensor-parallel group (--sequence-parallel)."""

    order: str = "tp-cp-ep-dp-pp"
    """Rank order of the parallel dims, as megatron-core's initialize_model_parallel takes it."""

    def __post_init__(self) -> None:
        _require_positive("parallel", tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                          etp=self.etp, vpp=self.vpp)
        if self.vpp is not None and self.pp < 2:
            raise ConfigError(f"parallel.vpp={self.vpp} needs parallel.pp > 1 (got pp={self.pp}); "
                              "unset vpp or raise pp")
        if self.sequence_parallel and self.tp < 2:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1; "
                              "turn it off or raise tp")


FRAMEWORKS = ("megatron", "deepspeed")


@dataclass(kw_only=True)
class TrainConfig:
    """Training loop settings (examples/pretrain_gpt.py; examples/deepspeed_train.py)."""

    framework: str = "megatron"
    """The training script of the job: megatron (megatron-core, examples/pretrain_gpt.py) or
    deepspeed (a DeepSpeed engine with ZeRO, examples/deepspeed_train.py)."""

    deepspeed_config: Optional[str] = None
    """framework=deepspeed: the DeepSpeed config JSON (ZeRO stage, precision, optimizer, buckets);
    None: configs/deepspeed/zero2.json. Its batch sizes are set from this section."""

    micro_batch_size: int = 2
    """Sequences per microbatch (--micro-batch-size)."""

    global_batch_size: int = 4
    """Sequences per iteration over all data-parallel replicas (--global-batch-size)."""

    iters: int = 2
    """Training iterations (--train-iters)."""

    lr: float = 1.0e-4
    """Adam learning rate (--lr)."""

    seed: int = 1234
    """Random seed (--seed)."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data parallel ranks (--use-distributed-optimizer)."""

    overlap_grad_reduce: bool = False
    """Overlap the gradient reduce-scatter/all-reduce with backward (--overlap-grad-reduce)."""

    recompute_granularity: Optional[str] = None
    """Activation recomputation (--recompute-granularity): full (whole layers: only their inputs are
    kept, the forward runs again in the backward), selective (the modules of `recompute_modules`),
    or None (everything kept)."""

    recompute_method: Optional[str] = None
    """With full: uniform (every layer's input every `recompute_num_layers` layers) or block (the
    first `recompute_num_layers` layers of each stage) (--recompute-method)."""

    recompute_num_layers: Optional[int] = None
    """With full: the layers of a recomputed group (uniform) or recomputed per stage (block)
    (--recompute-num-layers); None: 1."""

    recompute_modules: Optional[List[str]] = None
    """With selective: the submodules recomputed (--recompute-modules: core_attn, mlp, moe, moe_act,
    layernorm, shared_experts); None: megatron's default, core_attn."""

    device: str = "auto"
    """Where the sandbox computes: cuda if available (auto), cpu (gloo + CPU runtime), or cuda."""

    script: Optional[str] = None
    """The training script of the job (`prism-megatron capture|emulate|run|sweep|moe-check -- SCRIPT
    ARGS`; slices and sandboxes run it under `prism-megatron launch`); None: the built-in example of
    `framework` (examples/pretrain_gpt.py, examples/deepspeed_train.py), driven by this config."""

    script_args: List[str] = field(default_factory=list)
    """The script's own arguments (Megatron-LM's flags), without the `--prism-*` ones. The model,
    parallel and train keys prism knows a flag for are read from them (config/job.py)."""

    workdir: Optional[str] = None
    """Directory the script runs in (its relative paths: data, tokenizer); None: the repository for
    the built-in examples."""

    def __post_init__(self) -> None:
        _require_positive("train", micro_batch_size=self.micro_batch_size,
                          global_batch_size=self.global_batch_size, iters=self.iters)
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < float("inf"):
            raise ConfigError(f"train.lr={self.lr!r}: expected a finite learning rate > 0, e.g. 1.0e-4")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size({self.global_batch_size}) is not divisible by "
                f"train.micro_batch_size({self.micro_batch_size})")
        _check_recompute(self)
        if self.device not in DEVICES:
            raise ConfigError(f"train.device={self.device!r}; expected one of {', '.join(DEVICES)}")
        if self.framework not in FRAMEWORKS:
            raise ConfigError(f"train.framework={self.framework!r}; expected one of {', '.join(FRAMEWORKS)}")
        if self.deepspeed_config is not None and self.framework != "deepspeed":
            raise ConfigError(f"train.deepspeed_config={self.deepspeed_config} is set but train.framework="
                              f"{self.framework}; add train.framework=deepspeed or drop the DeepSpeed config")


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts")


def _check_recompute(t: "TrainConfig") -> None:
    if t.recompute_granularity is None:
        if t.recompute_method or t.recompute_num_layers or t.recompute_modules:
            raise ConfigError("train.recompute_method/num_layers/modules are set but "
                              "train.recompute_granularity is not; set it to full or selective")
        return
    require_choice("train.recompute_granularity", t.recompute_granularity, RECOMPUTE_GRANULARITIES)
    _require_positive("train", recompute_num_layers=t.recompute_num_layers)
    if t.recompute_granularity == "full":
        if t.recompute_method is None:
            raise ConfigError("train.recompute_granularity=full needs train.recompute_method: uniform "
                              "or block (Megatron-LM's --recompute-method)")
        require_choice("train.recompute_method", t.recompute_method, RECOMPUTE_METHODS)
        if t.recompute_modules:
            raise ConfigError("train.recompute_modules applies to recompute_granularity=selective; "
                              "drop it or choose selective")
    else:
        if t.recompute_method is not None or t.recompute_num_layers is not None:
            raise ConfigError("train.recompute_method/num_layers apply to recompute_granularity=full; "
                              "drop them or choose full")
        for module in t.recompute_modules or ():
            require_choice("train.recompute_modules[]", module, RECOMPUTE_MODULES)


@dataclass(kw_only=True)
class TraceConfig:
    """Recording this rank's execution graph (a slice of `prism-megatron capture`, or any run)."""

    path: Optional[str] = None
    """Write this rank's role graph here at the end of the run ({rank}: the virtual rank; with several
    processes and no {rank}, .rank<r> goes before the extension). None: do not record."""

    granularity: str = "module"
    """Compute nodes per module-level op (module) or per aten op inside each module (aten)."""

    timing: str = "two-pass"
    """two-pass: iterations alternate between labelled ones (a node per module boundary) and timed
    ones (cut only where the graph's dependencies need it, module hooks detached), and the graph takes
    its durations from a timed iteration, so the recorder's per-boundary host cost does not slow the
    iteration it measures (on a launch-bound GPU run that cost is device idle: +35% measured on an
    H200); single-pass: every iteration labelled and timed at once (the cost is in the durations)."""

    iteration: int = -1
    """Training iteration (1-based) that becomes the graph; -1: the last full one (an iteration runs
    from its forward_backward_func call to the next one's, so the second-to-last when the run has more
    than one). Memory peaks span the run."""

    selection: str = "last"
    """With iteration=-1, which iteration becomes the graph: the last full one (every rank of a
    multi-process recording takes the same one); `median`: the steady timed iteration of median
    length (trace/recorder.py `steady_iterations`; a steadier figure for one process; falls back to
    the last full one when there is no choice); `node-median`: that iteration's nodes with each
    interval between marks the median over the steady timed iterations (capture slices and
    emulation sandboxes use it; `median` when MoE routing differs per iteration)."""

    keep_iterations: bool = False
    """Also keep, beside the graph (`<path>.iterations.npz`), every node's duration in each iteration
    the graph's durations came from (emulation sandboxes do: their wall clock is checked iteration by
    iteration against the replay of that iteration's own compute)."""

    def __post_init__(self) -> None:
        if not isinstance(self.keep_iterations, bool):
            raise ConfigError(f"trace.keep_iterations={self.keep_iterations!r}; expected true or false")
        if self.selection not in SELECTIONS:
            raise ConfigError(f"trace.selection={self.selection!r}; expected one of {', '.join(SELECTIONS)}")
        if self.granularity not in GRANULARITIES:
            raise ConfigError(f"trace.granularity={self.granularity!r}; expected one of "
                              f"{', '.join(GRANULARITIES)}")
        if self.timing not in TIMINGS:
            raise ConfigError(f"trace.timing={self.timing!r}; expected one of {', '.join(TIMINGS)}")
        if self.iteration == 0 or not isinstance(self.iteration, int) or self.iteration < -1:
            raise ConfigError(f"trace.iteration={self.iteration!r}: expected an iteration number "
                              ">= 1, or -1 for the last")


@dataclass(kw_only=True)
class MoeConfig:
    """Routing of MoE layers: the model's own router, or a seeded load-imbalance model."""

    imbalance: str = "none"
    """none (the router decides), uniform, force-balanced, zipf(s), dirichlet(alpha) or
    hot-experts(h, p): every rank routes its tokens by this model (moe/imbalance.py), so sandboxes,
    ghosts and capture slices agree."""

    drift_per_iteration: float = 0.0
    """Experts the popularity order moves by per iteration (a wandering hot set); 0: fixed."""

    seed: int = 1234
    """Seed of the imbalance model (the same on every rank)."""

    log_path: Optional[str] = None
    """Write this rank's MoE load and memory per layer and microbatch here as JSON Lines ({rank}: the
    virtual rank), and a per-layer table at the end (moe/loadlog.py). None: no log."""

    def __post_init__(self) -> None:
        from prism_megatron.moe.imbalance import Imbalance, ImbalanceError

        try:
            Imbalance.parse(self.imbalance, self.seed, self.drift_per_iteration)
        except ImbalanceError as err:
            raise ConfigError(str(err)) from None

    def model(self):
        """The parsed imbalance model."""
        from prism_megatron.moe.imbalance import Imbalance

        return Imbalance.parse(self.imbalance, self.seed, self.drift_per_iteration)

    @property
    def routing_varies(self) -> bool:
        """Whether an imbalance model routes and its counts differ per iteration (uniform draws, a
        replayed log, drift): iterations then do not run the same work."""
        return self.imbalance != "none" and self.model().varies_per_iteration


@dataclass(kw_only=True)
class FaultsConfig:
    """Faults injected into the job (prism_megatron/faults/): stragglers, throttling, slow links and
    host stalls. The replay (simulate, emulate, `prism-megatron faults`) applies them to every rank they
    name; a real process they name (a plain run's rank or a sandbox) slows its own compute for real."""

    inject: Optional[str] = None
    """Fault specs separated by ';', e.g. "slow(4711, 1.5); throttle(node3, 1.3, 600); link(64-71, 2);
    stall(0, 0.5, 10)" (faults/spec.py). None: no fault."""

    def __post_init__(self) -> None:
        from prism_megatron.faults.spec import FaultError, parse_faults

        try:
            parse_faults(self.inject)
        except FaultError as err:
            raise ConfigError(f"faults.inject: {err}") from None


@dataclass(kw_only=True)
class PrismConfig:
    """Everything one run needs; cross-component checks live here."""

    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def __post_init__(self) -> None:
        self.check_world(self.emulation.virtual_world_size)
        if self.moe.imbalance != "none" and not self.model.num_experts:
            raise ConfigError(f"moe.imbalance={self.moe.imbalance!r} needs an MoE model: set "
                              "model.num_experts (or model=tiny_moe)")
        hot = self.moe.model()
        if hot.kind == "hot-experts" and self.model.num_experts and hot.params[0] > self.model.num_experts:
            raise ConfigError(f"moe.imbalance={self.moe.imbalance!r}: {int(hot.params[0])} hot experts of "
                              f"model.num_experts({self.model.num_experts}); choose at most "
                              f"{self.model.num_experts}")
        if self.train.framework == "deepspeed":
            changed = [f"{section}.{name}" for section, name in MEGATRON_ONLY
                       if getattr(getattr(self, section), name) != getattr(DEFAULTS[section], name)]
            if changed:
                raise ConfigError(f"{', '.join(changed)}: megatron-core layer choices that the DeepSpeed "
                                  "example does not build; drop them or use train.framework=megatron")
        fp8_recompute = {"mlp", "layernorm", "moe_act"} & set(self.train.recompute_modules or ())
        if self.model.fp8 and fp8_recompute:
            raise ConfigError(f"train.recompute_modules {sorted(fp8_recompute)} with model.fp8: megatron "
                              "recomputes these under FP8 through Transformer Engine only; recompute "
                              "core_attn, or full layers")
        if self.emulation.execution == "fake" and self.emulation.virtual_world_size is None:
            raise ConfigError("emulation.execution=fake needs a virtual world (its peers are ghosts): set "
                              "emulation.virtual_world_size (1 for the job of one rank)")
        e = self.emulation
        if e.clock == "realtime" and (e.delay_plan is None or e.virtual_world_size is None
                                      or self.trace.path is None):
            raise ConfigError("emulation.clock=realtime needs a virtual world, emulation.delay_plan and "
                              "trace.path (the recorder places the waits); run `prism-megatron emulate "
                              "--clock realtime`, which sets all three")

    def iterations_run(self) -> int:
        """Training iterations the job runs under the hooks: its own count, or emulation.stop_after
        where that ends it earlier."""
        stop = self.emulation.stop_after
        return min(stop, self.train.iters) if stop else self.train.iters

    def check_world(self, world_size: Optional[int]) -> None:
        """Validate the sizes against a world of `world_size` ranks (None: physical, not known yet)."""
        p, m = self.parallel, self.model
        stages = p.pp * (p.vpp or 1)
        if m.num_layers % stages:
            raise ConfigError(
                f"model.num_layers({m.num_layers}) is not divisible by parallel.pp({p.pp}) * "
                f"parallel.vpp({p.vpp or 1}) = {stages}; choose layers that split evenly")
        if m.num_attention_heads % p.tp:
            raise ConfigError(f"model.num_attention_heads({m.num_attention_heads}) is not divisible "
                              f"by parallel.tp({p.tp})")
        if m.num_experts is not None and m.num_experts % p.ep:
            raise ConfigError(f"model.num_experts({m.num_experts}) is not divisible by "
                              f"parallel.ep({p.ep})")
        if m.num_experts is None and p.ep > 1:
            raise ConfigError(f"parallel.ep={p.ep} needs an MoE model; set model.num_experts "
                              "(or model=tiny_moe)")
        if self.trace.iteration > self.train.iters:
            raise ConfigError(f"trace.iteration={self.trace.iteration} but train.iters="
                              f"{self.train.iters}; record an iteration that runs, or -1 for the last")
        if world_size is None:
            return
        from prism_megatron.world import (
            VirtualWorld,  # validates every divisibility of the world
        )

        try:
            world = VirtualWorld(world_size=world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                                 etp=p.etp, vpp=p.vpp, order=p.order,
                                 gpus_per_node=self.emulation.gpus_per_node)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        t = self.train
        if t.global_batch_size % (t.micro_batch_size * world.dp):
            raise ConfigError(
                f"train.global_batch_size({t.global_batch_size}) is not divisible by "
                f"train.micro_batch_size({t.micro_batch_size}) * dp({world.dp}) = "
                f"{t.micro_batch_size * world.dp}; raise the global batch size")
        microbatches = t.global_batch_size // (t.micro_batch_size * world.dp)
        # megatron's interleaved 1F1B runs micro-batches in groups of PP per virtual stage and
        # refuses a last group of 1..PP-1 (schedules.forward_backward_pipelining_with_interleaving)
        if p.vpp and (microbatches < p.pp or 0 < microbatches % p.pp < p.pp):
            fit = -(-microbatches // p.pp) * p.pp * t.micro_batch_size * world.dp
            raise ConfigError(
                f"parallel.vpp={p.vpp} runs {microbatches} micro-batches per pipeline, but megatron's "
                f"interleaved schedule needs a multiple of parallel.pp({p.pp}); set "
                f"train.global_batch_size={fit} (or unset vpp)")


MEGATRON_ONLY = tuple(("model", name) for name in (
    "kv_channels", "position_embedding_type", "rotary_base", "rotary_percent", "normalization",
    "norm_epsilon", "attention_backend", "attention_dropout", "hidden_dropout",
    "moe_shared_expert_intermediate_size", "moe_router_score_function", "fp8", "fp8_recipe",
    "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin")) + tuple(
    ("train", f"recompute_{name}") for name in ("granularity", "method", "num_layers", "modules"))
"""Keys only megatron-core's model (examples/pretrain_gpt.py, a Megatron-LM script) builds."""

SECTIONS: dict[str, type] = {"emulation": EmulationConfig, "parallel": ParallelConfig, "model": ModelConfig,
                             "train": TrainConfig, "trace": TraceConfig, "moe": MoeConfig}
"""The config's sections by key (one place for the flags, the CLI's key list and error hints)."""

DEFAULTS = {"model": ModelConfig(), "train": TrainConfig()}
