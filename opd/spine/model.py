"""The trained model and what samples from it: one loader and one rollout-engine factory.

    load_policy(cfg)        (model, tokenizer): dtype, device, LoRA through peft, gradient
                            checkpointing, dropout off when the loop compares with the
                            rollout engine's log-probs (GRPO's ratio); sharded over the ranks
                            of a World with FSDP2 when there are several (opd.spine.dist)
    make_engine(...)        the rollout engine a loop samples from: hf (the model itself) or
                            vLLM (a copy that receives the weights after every step)
    export_model(...)       RUN/model: the trained model as a loadable directory, LoRA merged

`opd sft`, `opd train` and `opd rl` train what `load_policy` returns; `opd validate`, `opd probe`
and the Ray rollout actors load their frozen copies with it too (`train=False`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from opd.checkpoint import rng_state, save_final_model, set_rng_state
from opd.fingerprint import load_model_tokenizer
from opd.lora import LoraSpec
from opd.rollout.base import RolloutEngine
from opd.rollout.hf import HFRolloutEngine
from opd.rollout.vllm import VLLMRolloutEngine   # imports vllm only when an engine is built
from opd.spine.config import ModelConfig, RolloutConfig
from opd.spine.dist import World, is_sharded, shard_model
from opd.spine.engine import RankZeroEngine
from opd.spine.load_shards import file_keys, params_on_meta, stream_weights, weight_files
from opd.spine.shards import broadcast_from_rank0, full_state_dict

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`auto`: cuda when it is available, else cpu; anything else as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_tokenizer(path: str | Path, what: str = "model.path"):
    """The model directory's tokenizer, with a pad token (EOS when it has none): every loop pads."""
    tokenizer = load_model_tokenizer(path, what)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(cfg: ModelConfig, *, seed: int | None = None, tokenizer=None, train: bool = True,
                dropout: bool = True, what: str = "model.path", world: World = World(),
                mixed_precision: bool | None = None, cpu_offload: bool = False):
    """(model, tokenizer) of `cfg.path` in `cfg.dtype` on `cfg.device`.

    train: gradient checkpointing and a fresh peft LoRA adapter as `cfg` says, train mode; False:
    a frozen copy in eval mode (no adapter, no checkpointing). dropout False turns every dropout
    off in train mode too (`disable_dropout`). A peft adapter directory is loaded onto its base
    and merged in. seed: the torch seed set before the weights exist (a LoRA adapter's init).
    tokenizer: one already loaded by `load_tokenizer`, else it is loaded here (`what` names the
    config key in its errors). world: with several ranks the trained model is sharded (FSDP2)
    onto each rank's device: every rank builds the model with no weight storage and rank 0
    streams the directory's safetensors into the ranks' shards one tensor at a time
    (`load_shards`); a LoRA start, or a directory whose keys do not cover the model, is read
    whole by rank 0 alone and broadcast (`shards.broadcast_from_rank0`); a peft adapter
    directory is read on every rank.
    mixed_precision (None: on CUDA) computes in bf16 with fp32 master shards and reductions;
    cpu_offload keeps the shards in CPU memory."""
    tokenizer = tokenizer or load_tokenizer(cfg.path, what)
    if seed is not None:
        torch.manual_seed(seed)
    dtype = TORCH_DTYPES[cfg.dtype]
    sharded = train and world.sharded
    adapter = (Path(cfg.path) / "adapter_config.json").is_file()
    keys = None
    if adapter:
        model = AutoPeftModelForCausalLM.from_pretrained(str(cfg.path), dtype=dtype).merge_and_unload()
    elif sharded:
        # Every rank builds the model without weight storage. Rank 0 then streams the files into
        # the ranks' shards (load_shards); where it cannot (a LoRA start whose adapter rank 0
        # initialises, renamed or missing keys, no safetensors) rank 0 reads the model whole
        # and broadcasts it, as before.
        with params_on_meta():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(cfg.path)), dtype=dtype)
        files = weight_files(cfg.path) if cfg.lora is None else None
        keys = file_keys(model, files) if files else None
        if keys is None and world.rank == 0:
            model = AutoModelForCausalLM.from_pretrained(str(cfg.path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(cfg.path), dtype=dtype)
    meta = next(model.parameters()).is_meta
    if not sharded:
        model.to(resolve_device(cfg.device))
    if not train:
        return model.eval(), tokenizer
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if cfg.lora is not None:
        model = add_lora(model, cfg.lora, cfg.path)
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()
    if not dropout:
        disable_dropout(model)
    if sharded:
        # A model built without storage allocates its shards only (to_empty) and receives them:
        # streamed from the files, or rank 0's whole weights (LoRA's adapter too), kept past
        # sharding to be broadcast.
        whole = model.state_dict() if world.rank == 0 and not meta else {}
        shard_model(model, world, cpu_offload=cpu_offload, meta=meta,
                    mixed_precision=world.device.type == "cuda" if mixed_precision is None else mixed_precision)
        if keys is not None:
            stream_weights(model, files, keys, world, dtype)
        else:
            broadcast_from_rank0(model, whole, world)
        del whole
    model.train()
    return model, tokenizer


def export_model(model, tokenizer, cfg: ModelConfig, target: Path, world: World = World()) -> Path:
    """`target`: a loadable model directory with the tokenizer, LoRA merged in. A sharded model
    is gathered to rank 0 (every rank calls this) and written from a whole copy built there
    from `cfg`; the random generators are left as they were."""
    if not is_sharded(model):
        return save_final_model(model, tokenizer, target)
    weights = full_state_dict(model)
    if world.main:
        state = rng_state()   # a LoRA adapter's init draws random numbers
        copy, _ = load_policy(replace(cfg, device="cpu", gradient_checkpointing=False), tokenizer=tokenizer)
        set_rng_state(state)
        copy.load_state_dict(weights)
        save_final_model(copy, tokenizer, target)
    world.barrier()
    return target


def add_lora(model, spec: LoraSpec, model_path: str = ""):
    """`model` wrapped by peft with a fresh adapter on the target modules that exist in it.

    A target module missing from this architecture is skipped; none present is an error.
    """
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in spec.target_modules if t in present]
    if not targets:
        raise ValueError(f"none of lora.target_modules {list(spec.target_modules)} exist in {model_path or 'the model'}")
    return get_peft_model(model, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                                            target_modules=targets, task_type="CAUSAL_LM"))


def disable_dropout(model) -> None:
    """Every dropout of the model off, in train mode too. GRPO's importance ratio compares the
    policy with the rollout engine's dropout-free log-probs: with dropout on, the ratios of a
    first epoch, which should all be 1, scatter far enough to be clipped (docs/grpo.md)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):   # transformers' attention
            module.attention_dropout = 0.0
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)


def make_engine(rollout: RolloutConfig, model_cfg: ModelConfig, model, tokenizer, *, seed: int,
                world: World = World()) -> RolloutEngine:
    """The rollout engine of `rollout.engine`. hf samples from `model` itself (always on-policy;
    a sharded model's ranks each sample their share and stop decoding together); vllm holds its
    own copy of `model_cfg.path`, given `model`'s weights now (a resumed or LoRA model differs
    from the directory) and after every optimizer step (`sync_weights`); a sharded model's
    ranks share one, on rank 0 (opd.spine.engine)."""
    if rollout.engine == "hf":
        return HFRolloutEngine(model, tokenizer, batch_size=rollout.batch_size, agree=world.all_true,
                               sharded=world.sharded)
    lora = {"rank": model_cfg.lora.rank} if model_cfg.lora is not None else None

    def build() -> VLLMRolloutEngine:
        return VLLMRolloutEngine(model_cfg.path, lora=lora, seed=seed, dtype=model_cfg.dtype,
                                 max_model_len=rollout.vllm_max_model_len,
                                 gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
                                 tensor_parallel_size=rollout.vllm_tensor_parallel_size,
                                 enforce_eager=rollout.vllm_enforce_eager)
    # A sharded student: one engine, on rank 0, serving every rank (opd.spine.engine).
    engine = RankZeroEngine(world, build() if world.main else None) if world.sharded else build()
    engine.sync_weights(model)
    return engine
