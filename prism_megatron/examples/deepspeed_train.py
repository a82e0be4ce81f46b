"""Train a GPT-like model with DeepSpeed (ZeRO 1, 2 or 3): plain, or as one rank of a virtual world.

Plain, under torchrun (gloo on CPU, NCCL on GPU):
    torchrun --nproc-per-node 4 examples/deepspeed_train.py --deepspeed-config configs/deepspeed/zero2.json
Virtualized: the same script as rank 5 of a 1024-way ZeRO data-parallel job, in one process:
    python examples/deepspeed_train.py --deepspeed-config configs/deepspeed/zero3.json \\
        --prism-virtual-world-size 1024 --prism-sandbox-ranks 5

What a DeepSpeed user writes: `deepspeed.init_distributed`, `deepspeed.initialize` with a config
JSON, and the engine's forward / backward / step. The only prism line is `prism_megatron.install(cfg)`
before `init_distributed`. The model's shape and the batch come from the Megatron-style flags
(`--hidden-size`, `--num-layers`, `--micro-batch-size`, `--global-batch-size`, ...): the micro batch
size and the gradient accumulation steps (global batch / (micro batch x data-parallel size), as in
Megatron) go into the DeepSpeed config. Data is mock: token ids drawn from a generator seeded by
(seed, iteration, data-parallel rank, microbatch), so every run sees the same.

With `--num-experts E --expert-model-parallel-size EP` every block's MLP is a DeepSpeed-MoE layer
(top-`--moe-router-topk` gating; `--moe-expert-capacity-factor` drops what exceeds the capacity, by
default it is dropless) and `--prism-moe-imbalance` routes its tokens by an imbalance model, e.g. rank
37 of EP64: `... --num-experts 64 --expert-model-parallel-size 64 --prism-virtual-world-size 64
--prism-sandbox-ranks 37 --prism-moe-imbalance "zipf(1.2)" --prism-moe-log-path moe{rank}.jsonl`.

The summary (`--prism-summary-json`) holds per-iteration losses, grad norms and times, the tracked
peak memory (CPU) or the allocator's peak (GPU), and this rank's model-state bytes (parameters,
gradients, optimizer state) as DeepSpeed holds them.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import prism_megatron
from prism_megatron.config import ConfigError
from prism_megatron.config.flags import OneLineParser, add_megatron_args, add_prism_args, config_from_args
from prism_megatron.resources import CONFIG_DIR, package_path
from prism_megatron.util import prepare_process

DEFAULT_DS_CONFIG = str(CONFIG_DIR / "deepspeed" / "zero2.json")


AUX_LOSS_COEFF = 1e-2  # DeepSpeed-MoE's load-balancing loss weight (Megatron's --moe-aux-loss-coeff)


def mlp(hidden: int, ffn: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


class Block(nn.Module):
    """Pre-norm attention and MLP; with `moe` (a dict of the model config's MoE fields) the MLP is a
    DeepSpeed-MoE layer: `num_experts` experts over `ep` ranks, top-k gating, the capacity factor or
    dropless. Its forward returns the output and the MoE aux loss (0 for a dense block)."""

    def __init__(self, hidden: int, heads: int, moe: dict | None = None) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        if moe:
            from deepspeed.moe.layer import MoE

            factor = moe["capacity_factor"]
            self.mlp = MoE(hidden, mlp(hidden, moe["ffn"]), num_experts=moe["experts"], ep_size=moe["ep"],
                           k=moe["topk"], capacity_factor=factor or 1.0, eval_capacity_factor=factor or 1.0,
                           drop_tokens=factor is not None)
        else:
            self.mlp = mlp(hidden, 4 * hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.input_layernorm(x)
        x = x + self.self_attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        out = self.mlp(self.pre_mlp_layernorm(x))
        if isinstance(out, tuple):  # DeepSpeed-MoE: (output, aux loss, expert counts)
            return x + out[0], out[1]
        return x + out, x.new_zeros(())


def moe_of(cfg) -> dict | None:
    m = cfg.model
    if not m.num_experts:
        return None
    return {"experts": m.num_experts, "ep": cfg.parallel.ep, "topk": m.moe_router_topk,
            "ffn": m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size,
            "capacity_factor": m.moe_expert_capacity_factor}


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks, final norm, untied output layer."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int,
                 moe: dict | None = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.position_embedding = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, moe) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("causal", torch.full((seq, seq), float("-inf")).triu(1), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embedding(tokens) + self.position_embedding(torch.arange(s, device=tokens.device))
        mask = self.causal[:s, :s].to(x.dtype)
        aux = x.new_zeros(())
        for layer in self.layers:
            x, layer_aux = layer(x, mask)
            aux = aux + layer_aux
        logits = self.output_layer(self.final_layernorm(x))
        loss = nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
        return loss + AUX_LOSS_COEFF * aux.float()


def accumulation_steps(cfg, dp: int) -> int:
    t = cfg.train
    return t.global_batch_size // (t.micro_batch_size * dp)


class EmbeddingPipe(nn.Module):
    """Pipeline stage pieces (DeepSpeed's PipelineModule passes one tensor between layers)."""

    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.position_embedding = nn.Embedding(seq, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.embedding(tokens) + self.position_embedding(positions)


class BlockPipe(Block):
    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__(hidden, heads)
        self.register_buffer("causal", torch.full((seq, seq), float("-inf")).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        return super().forward(x, self.causal[:s, :s].to(x.dtype))[0]


class HeadPipe(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.final_layernorm = nn.LayerNorm(hidden)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.final_layernorm(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def pipeline_model(cfg, stages: int):
    """TinyGPT as DeepSpeed's PipelineModule: embedding, blocks, head, split uniformly by layers."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    m = cfg.model
    layers = [LayerSpec(EmbeddingPipe, m.vocab_size, m.hidden_size, m.seq_length),
              *[LayerSpec(BlockPipe, m.hidden_size, m.num_attention_heads, m.seq_length)
                for _ in range(m.num_layers)],
              LayerSpec(HeadPipe, m.hidden_size, m.vocab_size)]
    return PipelineModule(layers=layers, num_stages=stages, loss_fn=lm_loss, partition_method="uniform")


def read_ds_config(args, cfg) -> dict:
    """The DeepSpeed config file as it stands, read before any work (a bad one is refused at once)."""
    path = args.deepspeed_config or cfg.train.deepspeed_config or DEFAULT_DS_CONFIG
    if not os.path.isabs(path) and not os.path.exists(path):
        path = str(package_path(path))  # a shipped one, as `configs/deepspeed/zero3.json` names it
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--deepspeed-config {path}: {err}; give a DeepSpeed config JSON "
                          f"such as {DEFAULT_DS_CONFIG}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed-config {path}: expected a JSON object, got {type(data).__name__}; "
                          f"give a DeepSpeed config JSON such as {DEFAULT_DS_CONFIG}")
    return data


def ds_config(args, cfg, dp: int, data: dict) -> dict:
    """The DeepSpeed config: the file's `data`, with the batch from the flags and `--zero-stage` applied."""
    data = dict(data)
    t = cfg.train
    data["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    data.pop("train_batch_size", None)
    data["gradient_accumulation_steps"] = accumulation_steps(cfg, dp)
    if args.zero_stage is not None:
        data.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    data.setdefault("optimizer", {"type": "AdamW", "params": {"lr": t.lr, "torch_adam": True}})
    data.setdefault("steps_per_print", 10 ** 9)
    return data


def batches(cfg, iteration: int, dp_rank: int, count: int, device: str):
    m, t = cfg.model, cfg.train
    for micro in range(count):
        gen = torch.Generator().manual_seed(hash((t.seed, iteration, dp_rank, micro)) & 0x7FFFFFFF)
        tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1), generator=gen)
        yield tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def train(args, cfg, inst, summary_path, ds_file: dict) -> None:
    import deepspeed

    from prism_megatron.hooks.deepspeed import model_state_bytes

    device = inst.device
    prepare_process(device)  # plain `python` is a world of one; on cuda, the LOCAL_RANK's GPU
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    m, stages = cfg.model, cfg.parallel.pp
    torch.manual_seed(cfg.train.seed)
    if stages > 1:
        if m.num_experts:
            raise ConfigError("this example's pipeline model has no MoE layers; drop model.num_experts "
                              "or use --pipeline-model-parallel-size 1")
        model = pipeline_model(cfg, stages)
    else:
        model = TinyGPT(m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads, m.seq_length,
                        moe_of(cfg))
    dp = dist.get_world_size() // stages  # ZeRO's data parallelism: the world, over the stages
    config = ds_config(args, cfg, dp, ds_file)
    params = [p for p in model.parameters() if p.requires_grad]
    if m.num_experts:  # ZeRO keeps expert parameters in their own groups (expert data parallelism)
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "params"})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    rank = dist.get_rank()
    dp_rank = engine.grid.get_data_parallel_rank() if stages > 1 else rank
    summary = {"virtual_rank": rank, "virtual_world_size": dist.get_world_size(),
               "zero_stage": engine.zero_optimization_stage(), "losses": [], "grad_norms": [],
               "iteration_times_ms": [],
               "num_parameters": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                     for p in model.parameters())}
    for it in range(1, cfg.train.iters + 1):
        start = time.perf_counter()
        losses = []
        micro = batches(cfg, it, dp_rank, accumulation_steps(cfg, dp), device)
        if stages > 1:  # the whole 1F1B schedule; the loss arrives from the last stage
            losses.append(float(engine.train_batch(data_iter=micro)))
        for tokens, labels in (micro if stages == 1 else ()):
            loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        norm = engine.get_global_grad_norm()
        summary["losses"].append(sum(losses) / len(losses))
        summary["grad_norms"].append(float(norm) if norm is not None else None)
        summary["iteration_times_ms"].append(elapsed_ms)
        print(f" [rank {rank}] iteration {it}/{cfg.train.iters} | loss: {summary['losses'][-1]:.6E} | "
              f"grad norm: {summary['grad_norms'][-1]} | iteration time (ms): {elapsed_ms:.1f}", flush=True)
    summary["model_state_bytes"] = model_state_bytes(engine)
    summary["model_state_peak_bytes"] = getattr(engine, "prism_model_state_peak_bytes", None)
    if not inst.write_summary(summary, summary_path):
        print(f"error: non-finite loss or grad norm on rank {rank}", file=sys.stderr)
        sys.exit(1)


def main(argv=None) -> int:
    parser = OneLineParser(prog="deepspeed_train.py", description=__doc__.splitlines()[0])
    add_megatron_args(add_prism_args(parser))
    group = parser.add_argument_group("deepspeed")
    group.add_argument("--deepspeed-config", default=None,
                       help="DeepSpeed config JSON (default: train.deepspeed_config, else "
                            "configs/deepspeed/zero2.json)")
    group.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                       help="overrides zero_optimization.stage of the config")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args, getattr(args, "prism_config", None))
        if cfg.emulation.virtual_world_size is None:
            cfg.check_world(int(os.environ.get("WORLD_SIZE", "1")))
        ds_file = read_ds_config(args, cfg)  # before any work: a bad file is one line at once
        inst = prism_megatron.install(cfg)
        train(args, cfg, inst, getattr(args, "prism_summary_json", None), ds_file)
    except ConfigError as err:
        print(f"deepspeed_train.py: error: {err}", file=sys.stderr)
        return 2
    inst.uninstall()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
