"""Pretrain a GPT with megatron-core: a real training loop, plain or as one rank of a virtual world.

Plain, under torchrun (gloo on CPU, NCCL on GPU):
    torchrun --nproc-per-node 4 examples/pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --global-batch-size 8
Virtualized: the same script as rank 4711 of 8192 ranks, in one process:
    python examples/pretrain_gpt.py --prism-virtual-world-size 8192 --prism-sandbox-ranks 4711 \
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --num-layers 16 \
        --global-batch-size 128 --micro-batch-size 1 --num-attention-heads 8

Everything megatron-specific below is what a Megatron-LM user writes; the only prism line is
`prism_megatron.install(cfg)`. Data is mock: token ids drawn from a generator seeded by
(seed, iteration, data-parallel rank, microbatch), so every run and every rank of a role sees the same.

Logging: a first line says what is modelled (model, layout, micro-batches, sandbox, execution), then
one Megatron-style line per iteration, and a last line where the summary went. The loss lives on the
last pipeline stage; it is broadcast over the pipeline group for logging (one small broadcast per
iteration, as NeMo does). On a sandbox whose last stage is a ghost there is no loss to receive: it
logs `lm loss: n/a` and records null, and the gradient norm (computed by every rank) is the figure to
watch there. Under fake execution tensors hold no values (a norm's `.item()` is a placeholder 1.0,
runtime/fake.py), so the loss and grad norm are logged `n/a` and recorded null.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

import prism_megatron
from prism_megatron.config import ConfigError
from prism_megatron.config.flags import (
    OneLineParser,
    add_megatron_args,
    add_prism_args,
    config_from_args,
)
from prism_megatron.util import prepare_process


def build_model(cfg, device, cpu_initialization=None):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.module import Float16Module

    m, p = cfg.model, cfg.parallel
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[m.params_dtype]
    moe = {}
    if m.num_experts:
        moe = dict(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                   moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size,
                   moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                   moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
        if m.moe_expert_capacity_factor is not None:
            moe.update(moe_expert_capacity_factor=m.moe_expert_capacity_factor, moe_token_drop_policy="probs")
        if m.moe_shared_expert_intermediate_size:
            moe.update(moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size)
        moe.update(moe_router_score_function=m.moe_router_score_function)
    t = cfg.train
    recompute = {}
    if t.recompute_granularity == "full":
        recompute = dict(recompute_granularity="full", recompute_method=t.recompute_method,
                         recompute_num_layers=t.recompute_num_layers or 1)
    elif t.recompute_granularity == "selective":
        recompute = dict(recompute_granularity="selective",
                         recompute_modules=list(t.recompute_modules or ["core_attn"]))
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size, tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp, virtual_pipeline_model_parallel_size=p.vpp,
        context_parallel_size=p.cp, expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp, sequence_parallel=p.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=device == "cpu" if cpu_initialization is None else cpu_initialization,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, kv_channels=m.kv_channels, normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon, attention_backend=AttnBackend[m.attention_backend],
        add_bias_linear=not m.num_experts and not m.swiglu, deallocate_pipeline_outputs=True,
        num_query_groups=m.num_query_groups, gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        fp8=m.fp8, fp8_recipe=m.fp8_recipe, fp8_amax_history_len=m.fp8_amax_history_len,
        fp8_amax_compute_algo=m.fp8_amax_compute_algo, fp8_margin=m.fp8_margin, **moe,
        **recompute)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype != torch.float32,
        overlap_grad_reduce=cfg.train.overlap_grad_reduce,
        use_distributed_optimizer=cfg.train.use_distributed_optimizer, bucket_size=None)
    padded_vocab = _padded_vocab(m.vocab_size, p.tp)
    chunks = []
    for vp_stage in range(p.vpp or 1):
        vp = vp_stage if p.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(m.num_experts, moe_grouped_gemm=False,
                                                            normalization=m.normalization),
            vocab_size=padded_vocab, max_sequence_length=m.seq_length,
            position_embedding_type=m.position_embedding_type, rotary_percent=m.rotary_percent,
            rotary_base=m.rotary_base,
            share_embeddings_and_output_weights=m.tie_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp), vp_stage=vp)
        if device == "cuda":
            model.cuda(torch.cuda.current_device())
        if dtype != torch.float32:
            model = Float16Module(config, model)
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=model))
    return config, chunks


def _padded_vocab(vocab_size: int, tp: int) -> int:
    multiple = 128 * tp  # Megatron-LM's --make-vocab-size-divisible-by default times tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def mock_batches(cfg, iteration: int, device: str):
    """The microbatches of one iteration for this data-parallel rank (deterministic)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    m, t = cfg.model, cfg.train
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    num_micro = t.global_batch_size // (t.micro_batch_size * dp_size)
    for micro in range(num_micro):
        gen = torch.Generator().manual_seed(hash((t.seed, iteration, dp_rank, micro)) & 0x7FFFFFFF)
        tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1), generator=gen)
        batch = {
            "tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(t.micro_batch_size, m.seq_length),
            "position_ids": torch.arange(m.seq_length).unsqueeze(0).expand(t.micro_batch_size, -1),
        }
        batch = {k: v.to(device) for k, v in batch.items()}
        yield get_batch_on_this_cp_rank(batch)


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def loss_func(loss_mask, output_tensor):
    """Megatron-LM's form: (sum of token losses, token count, report); the schedule divides by the
    count, which keeps gradients right under context parallelism."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss_sum.detach().view(1), mask.sum().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def train(cfg, inst, summary_path):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    device = inst.device
    prepare_process(device)  # plain `python` is a world of one; on cuda, the LOCAL_RANK's GPU
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    p = cfg.parallel
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp, context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp, order=p.order)
    torch.manual_seed(cfg.train.seed)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    # fake execution predicts a GPU: parameters are made as on a GPU (megatron's default), not the
    # CPU path's full-size master weights split afterwards
    config, chunks = build_model(cfg, device, cpu_initialization=device == "cpu" and inst.execution == "real")
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cfg.train.lr, weight_decay=0.01, clip_grad=1.0,
                        bf16=config.bf16, fp16=config.fp16,
                        use_distributed_optimizer=cfg.train.use_distributed_optimizer),
        chunks)
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    if cfg.train.overlap_grad_reduce:
        config.grad_sync_func = ([c.start_grad_sync for c in chunks] if len(chunks) > 1
                                 else chunks[0].start_grad_sync)
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    t, rank = cfg.train, dist.get_rank()
    num_micro = t.global_batch_size // (t.micro_batch_size * ps.get_data_parallel_world_size())
    pp_group, last_stage = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
    summary = {"virtual_rank": rank, "virtual_world_size": dist.get_world_size(), "losses": [],
               "grad_norms": [], "iteration_times_ms": [],
               "ghost_policy": cfg.emulation.ghost_policy if inst.virtual else None,
               "backend_host_s_per_iteration": [], "backend_host_cpu_s_per_iteration": [],
               "allocator_per_iteration": []}
    log = inst.session.log if inst.session is not None else None
    # fake execution (a GPU-sized rank on a CPU): times come from the target GPU's kernel-cost model
    clock = inst.fake.clock if inst.fake is not None else None
    print(f" [rank {rank}] modelled: {describe_job(cfg, inst, num_micro)}", flush=True)
    if clock is not None:
        print(f" [rank {rank}] execution: fake (tensors without storage); kernel times of "
              f"{cfg.emulation.target_gpu}, {clock.model.source}; memory: CUDA caching-allocator model",
              flush=True)
    for it in range(1, t.iters + 1):
        start = time.perf_counter()
        start_modelled = clock.mark() if clock is not None else 0.0
        backend_start = log.host_s if log is not None else 0.0
        backend_cpu_start = log.host_cpu_s if log is not None else 0.0
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = [mock_batches(cfg, it, device) for _ in chunks]
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=num_micro,
            seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
            forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        loss = _pipeline_loss(losses, pp_group, last_stage, inst, device)
        if clock is not None:  # fake tensors hold no values: what .item() gave is a placeholder
            loss, grad_norm = None, None
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if clock is not None:  # the rank's own modelled time; ghosts answer at once (no waits)
            clock.sync()
            elapsed_ms = (clock.mark() - start_modelled) * 1e3
        summary["losses"].append(loss)
        summary["grad_norms"].append(float(grad_norm) if grad_norm is not None else None)
        summary["iteration_times_ms"].append(elapsed_ms)
        if log is not None:  # the prism backend's own host time in this iteration
            summary["backend_host_s_per_iteration"].append(log.host_s - backend_start)
            summary["backend_host_cpu_s_per_iteration"].append(  # counted under fake execution only
                log.host_cpu_s - backend_cpu_start if log.cpu_timed else None)
        if device == "cuda":  # the caching allocator's retries and device calls so far (cumulative)
            stats = torch.cuda.memory_stats()
            summary["allocator_per_iteration"].append(
                {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS})
        where = f" (modelled on {cfg.emulation.target_gpu})" if clock is not None else ""
        if clock is not None:
            values = "lm loss, grad norm: n/a (fake execution: tensors hold no values)"
        else:
            shown = (f"n/a (the last pipeline stage, rank {last_stage}, is a ghost)" if loss is None
                     else f"{loss:.6E}")
            values = f"lm loss: {shown} | grad norm: {summary['grad_norms'][-1]}"
        print(f" [rank {rank}] iteration {it}/{t.iters} | {values} | iteration time (ms){where}: "
              f"{elapsed_ms:.1f}", flush=True)
    if clock is not None:
        allocator = inst.tracker.allocator
        print(f" [rank {rank}] predicted peak memory on {cfg.emulation.target_gpu}: allocated "
              f"{allocator.peak_allocated / 2**30:.2f} GiB, reserved "
              f"{allocator.peak_reserved / 2**30:.2f} GiB", flush=True)
    _finish(summary, inst, summary_path)


ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def _pipeline_loss(losses, pp_group, last_stage, inst, device):
    """Mean lm loss of the iteration, from the last pipeline stage (None if that stage is a ghost).

    Every stage takes part in the broadcast, as at scale, so a sandbox's communication is a real
    rank's; what a ghost last stage "sends" is not a loss, so it is not reported."""
    value = torch.zeros(1, device=device)
    if losses:  # per microbatch [sum of token losses, tokens]
        totals = torch.stack([x["lm loss"].float() for x in losses]).sum(dim=0)
        value[0] = totals[0] / totals[1]
    if dist.get_world_size(pp_group) > 1:
        dist.broadcast(value, src=last_stage, group=pp_group)
        if inst.session is not None and inst.session.physical.physical_of(last_stage) is None:
            return None
    return float(value.item())


def describe_job(cfg, inst, num_micro: int) -> str:
    """One line of what this run models: the model (a preset's name where it is one), the parallel
    layout and world, micro-batches per pipeline, the sandbox, the execution and target GPU."""
    from megatron.core import parallel_state as ps

    from prism_megatron.config.loader import MODEL_PRESETS

    m, p = cfg.model, cfg.parallel
    preset = next((name for name, preset in MODEL_PRESETS.items() if preset == m), None)
    n = m.parameters()
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    model = f"{preset or 'GPT'} of {size} parameters ({m.num_layers} layers, hidden " \
            f"{m.hidden_size}{f', {m.num_experts} experts' if m.num_experts else ''})"
    axes = [("TP", p.tp), ("CP", p.cp), ("PP", p.pp), ("DP", ps.get_data_parallel_world_size()), ("EP", p.ep)]
    layout = " x ".join(f"{name}{n}" for name, n in axes if n > 1 or name in ("TP", "PP", "DP"))
    world = dist.get_world_size()
    line = (f"{model} | {layout}, {world} ranks | {num_micro} micro-batches of {cfg.train.micro_batch_size} "
            "per pipeline")
    if inst.virtual:
        line += (f" | sandbox: rank {dist.get_rank()} (pipeline stage {ps.get_pipeline_model_parallel_rank()}"
                 f" of {p.pp}), {world - len(cfg.emulation.sandbox_ranks)} ghosts")
    execution = (f"fake on {inst.device}, predicting {cfg.emulation.target_gpu}" if inst.fake is not None
                 else f"real on {inst.device}")
    return f"{line} | execution: {execution}"


def _finish(summary, inst, summary_path):
    if not inst.write_summary(summary, summary_path):
        print(f"error: non-finite loss or grad norm on rank {summary['virtual_rank']}", file=sys.stderr)
        sys.exit(1)
    where = inst.summary_written or "not written (give --prism-summary-json PATH)"
    print(f" [rank {summary['virtual_rank']}] summary: {where}", flush=True)

def main(argv=None) -> int:
    parser = OneLineParser(prog="pretrain_gpt.py", description=__doc__.splitlines()[0])
    add_megatron_args(add_prism_args(parser))
    args = parser.parse_args(argv)  # unknown flags: one line, exit 2
    try:
        cfg = config_from_args(args)
        if cfg.emulation.virtual_world_size is None:
            cfg.check_world(int(os.environ.get("WORLD_SIZE", "1")))
        inst = prism_megatron.install(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        train(cfg, inst, args.prism_summary_json)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        inst.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
