"""Loading: a WeightSource's weights placed as an EngineConfig says, into an Engine (runtime/engine.py).

    eng = load_engine(open_source("synth:tiny"), ecfg)

Dense weights (attention, norms, routers, embeddings) go to the device; each MoE layer's experts to the device or,
for host layers (--cpu-moe / --n-cpu-moe), to pinned host memory behind the host provider (runtime/placement.py:
the expert cache, or uploads per ubatch), each expert's rows one contiguous row (experts/store.py).
"""
from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from ..config import ModelConfig
from ..device import Device
from ..engine_config import EngineConfig
from ..errors import UserError
from ..experts.provider import LayerRouter, ResidentExperts
from ..experts.routing import RoutingStore
from ..experts.store import ExpertStore, fill_layer
from ..kernels import AddressBook, by_address_kernels, pick_kernel
from ..kernels.delta import pick_delta_kernels
from ..kernels.qsa import pick_qsa_kernels
from ..kernels.ple_gather import gathers_blocks
from ..loading.gguf import MappedRows
from ..models.ple import BlockTable, readable_in_place
from ..arch.families import AFTER_TRUNK, FAMILIES
from ..models.layers import rope_tables
from ..arch.names import HOST_TABLES, dense_names, keeps_float32, optional_names
from ..models.transformer import MoETransformer
from ..quant.layout import expert_layouts
from .engine import DTYPES, MiB, Engine
from .caches import make_cache
from .sliding_kv import engine_ring
from .memory import available_host_memory
from .placement import fit_cache, fit_split, host_provider, split_provider
from .plan import decode_plan
from .split import Split

log = logging.getLogger("moestream")


def model_config(cfg: ModelConfig, ecfg: EngineConfig) -> ModelConfig:
    """The config the engine runs: the checkpoint's, with its MTP head (cfg.head_layers) only where speculation
    asks for it (--spec-type draft-mtp), so that a head costs no memory otherwise."""
    if not ecfg.spec.mtp:
        return cfg.replace(nextn_layers=0)
    fam = FAMILIES[cfg.family]
    if not (fam.hf_mtp or fam.gguf_mtp):
        raise UserError(f"--spec-type draft-mtp: moestream reads no MTP head of a {fam.title} model; drop --spec-type")
    if not cfg.nextn_layers:
        hf = ("none read: transformers drops mtp.*" if not fam.hf_mtp else
              "model.layers.{n}.eh_proj and num_nextn_predict_layers" if fam.hf_mtp[1] == AFTER_TRUNK else
              f"{fam.hf_mtp[1]}* and {fam.hf_mtp[0]}")
        raise UserError(f"--spec-type draft-mtp: this {fam.title} checkpoint ships no MTP head (HF: {hf}; GGUF: "
                        "nextn_predict_layers and blk.N.nextn.*); drop --spec-type")
    return cfg


def head_io(source, cfg: ModelConfig, weights: dict, device_of, dtype) -> dict:
    """An MTP head's own embedding and output head (optional_names) where the source has them and they differ from
    the trunk's token_embd and output (the published DeepSeek-V3 and GLM-4.5 checkpoints ship copies: kept once).
    device_of(name): where a tensor goes."""
    trunk = {"nextn.embed_tokens.weight": weights["token_embd.weight"],
             "nextn.shared_head_head.weight": weights.get("output.weight", weights["token_embd.weight"])}
    out = {}
    for n in optional_names(cfg):
        if source.has(n):
            same = trunk[n.split(".", 2)[2]]
            t = source.tensor(n).to(device=same.device, dtype=dtype)      # compared where the trunk's is
            if not torch.equal(t, same):
                out[n] = t.to(device_of(n))
    return out


def host_tables(source, cfg, dev: Device, room: int | None = None) -> dict:
    """The host tables (arch/names.py's HOST_TABLES: the PLE's n-gram rows) as the source holds them, read by row
    (models/ple.py's PLETable): a tensor, on a GPU copied once into pinned memory, so that a decode step's kernel
    reads its rows in place (a CUDA graph can capture it); a GGUF's quantized table, on a GPU, its blocks copied
    once as the file holds them into pinned memory (models/ple.py's BlockTable: that kernel dequantizes them) where
    the gather decodes its type and `room` (host bytes free for it; None: not known) holds them; else its mapped
    rows stay mapped (dequantized on the host by row: that step reads the host, so it is not captured)."""
    out = {}
    for n in dense_names(cfg):
        if n in HOST_TABLES:
            t = source.rows(n)
            if dev.is_cuda and isinstance(t, torch.Tensor) and not t.is_pinned():
                t = dev.pinned_empty(t.shape, t.dtype).copy_(t)
            elif dev.is_cuda and isinstance(t, MappedRows) and gathers_blocks(t.qtype, t.shape[1]):
                t = pinned_blocks(t, n, dev, room)
            out[n] = t
    return out


def pinned_blocks(t: MappedRows, name: str, dev: Device, room: int | None):
    """A GGUF's quantized table t as a BlockTable of its blocks copied into pinned host memory, or t itself (mapped,
    with a one-line warning) where `room` cannot hold them."""
    need = t.nbytes
    if room is not None and need > room:
        log.warning("%s: its %s blocks (%.0f MiB) do not fit the %.0f MiB of host memory left: read mapped from the "
                    "file, dequantized on the host by row (decode steps not captured in CUDA graphs)",
                    name, t.qtype.name, need / MiB, max(room, 0) / MiB)
        return t
    blocks = dev.pinned_empty((t.shape[0], t.row_bytes), torch.uint8)
    t.copy_into(blocks)
    log.info("%s: %.0f MiB of %s blocks pinned in host memory, read in place by decode steps", name, need / MiB,
             t.qtype.name)
    return BlockTable(blocks, t.qtype, t.shape[1])


def load_engine(source, ecfg: EngineConfig, progress: bool = True) -> Engine:
    """Place `source`'s weights as `ecfg` (resolved: EngineConfig.resolve, as LLM does) says."""
    if not ecfg.resolved:
        raise ValueError("load_engine takes a resolved EngineConfig: runtime.plan.resolve(ecfg, file_dtype) first")
    cfg = model_config(source.config, ecfg)
    split = layer_split(cfg, ecfg)              # None: one device, the path as it always was
    dev = split.devices[0] if split else Device.resolve(ecfg.placement.device)
    dtype = DTYPES[ecfg.placement.dtype]
    host = ecfg.placement.host_layers(cfg)
    ctx = ecfg.batching.ctx_size
    if ctx > cfg.max_position_embeddings:
        log.warning("context %d is longer than the model's trained %d positions", ctx, cfg.max_position_embeddings)
    layouts = expert_layouts(source, cfg)
    quantized = any(lay.quantized for lay in layouts.values())
    row_dtype = torch.uint8 if quantized else dtype           # quantized rows are their GGUF blocks
    width = {l: lay.nbytes if quantized else lay.numel for l, lay in layouts.items()}
    blocks = FAMILIES[cfg.family].blocks         # the family table says which blocks the decoder is built from
    host_experts = sum(cfg.n_experts * width[l] for l in host) * row_dtype.itemsize     # pinned below
    free = available_host_memory() if dev.is_cuda else None
    tables = host_tables(source, cfg, dev, None if free is None else free - host_experts)
    qsa = pick_qsa_kernels(dev.torch, cfg) if blocks.attention.kind == "qsa" else None
    capturable = MoETransformer.capturable_for(cfg, all(readable_in_place(t) for t in tables.values()),
                                               qsa is not None)
    plan = decode_plan(ecfg, dev.is_cuda, quantized, bool(host), capturable,
                       by_address_kernels(blocks))          # how decode steps run
    if split is None:
        ecfg, n_slots = fit_cache(cfg, ecfg, plan, dev, dtype, host, layouts)   # (--moe-cache-mib auto: in MiB)
    else:
        ecfg, n_slots = fit_split(cfg, ecfg, plan, split, dtype, host, layouts)  # a pool per device: {d: slots}
    where = (lambda layer: dev.torch) if split is None else (lambda layer: split.device(layer).torch)

    names = dense_names(cfg)
    moe = cfg.expert_layers
    bar = tqdm(total=len(names) + len(moe), desc="loading", unit="tensor", disable=not progress, leave=False)
    weights = {}
    for n in names:
        if n in HOST_TABLES:        # the PLE's n-gram rows, read above (host_tables)
            weights[n] = tables[n]
        else:
            weights[n] = source.tensor(n).to(device=_device_of(n, cfg, dev, split),
                                             dtype=torch.float32 if keeps_float32(n) else dtype)
        bar.update()
    if split is not None and "output.weight" not in weights:        # tied: the lm_head on the last device too
        weights["output.weight"] = weights["token_embd.weight"].to(split.devices[-1].torch)
    weights |= head_io(source, cfg, weights, lambda n: _device_of(n, cfg, dev, split), dtype)
    staging = None
    host_rows, dev_rows = {}, {}
    for l in moe:
        shape = (cfg.n_experts, width[l])
        if l in host:
            host_rows[l] = dev.pinned_empty(shape, row_dtype)       # (E, row), pinned once
            fill_layer(host_rows[l], source, l, layouts[l])
        elif dev.is_cuda:
            if staging is None or staging.shape != shape:
                staging = dev.pinned_empty(shape, row_dtype)
            fill_layer(staging, source, l, layouts[l])
            dev_rows[l] = staging.to(where(l), non_blocking=False)
        else:
            dev_rows[l] = torch.empty(shape, dtype=row_dtype)
            fill_layer(dev_rows[l], source, l, layouts[l])
        bar.update()
    bar.close()
    del staging

    providers: dict[int, object] = {}
    hosted = None
    if dev_rows:
        resident = ResidentExperts(dev_rows, layouts)
        providers.update({l: resident for l in dev_rows})
    routing = RoutingStore(cfg.n_stored_layers, cfg.n_experts, ecfg.batching.n_seq, dev.torch)   # the cache's, ours
    if host_rows and split is not None:
        hosted = split_provider(cfg, ecfg, plan, split, host_rows, layouts, n_slots)
        providers.update({l: hosted for l in host_rows})
    elif host_rows:
        store = ExpertStore(host_rows, {l: layouts[l] for l in host_rows})
        hosted = host_provider(cfg, ecfg, plan, store, dev, n_slots, routing)
        providers.update({l: hosted for l in host_rows})
        log.info("experts: %d layers in pinned host memory (%.0f MiB), %d on the device",
                 len(host_rows), store.nbytes / MiB, len(dev_rows))
    rope = rope_tables(cfg, ctx, dev.torch)
    delta = pick_delta_kernels(dev.torch, dtype) if blocks.mixer == "deltanet" else None
    model = MoETransformer(cfg, weights, rope, blocks, delta, split, qsa)
    kv = make_cache(cfg, ecfg.batching.n_seq, ctx, dtype, dev.torch, None if split is None else where,
                    engine_ring(cfg, ecfg))
    kernel = pick_kernel(ecfg.kernel, dev.torch, dtype)
    book = AddressBook()
    for rows in (*dev_rows.values(), *host_rows.values()):
        book.add(rows)
    engine = Engine(cfg, ecfg, model, LayerRouter(providers), kv, kernel, dev, plan, hosted, book, routing,
                    quantized, split)
    if ecfg.spec.mtp and ecfg.spec.draft_n_max is None and engine.draft_n_max == 0:
        log.info("spec: no drafts with host experts and no cache (each drafted token's experts would cross the link "
                 "again in the verify step); --spec-draft-n-max N drafts anyway, a cache (--moe-cache-mib) brings "
                 "them back")
    return engine


def layer_split(cfg: ModelConfig, ecfg: EngineConfig) -> Split | None:
    """The split of a resolved placement over several devices (runtime/split.py), or None for one device. One-line
    UserErrors for what a split does not run yet."""
    names = ecfg.placement.device.split(",")
    if len(names) == 1:
        return None
    if cfg.ple_layers or cfg.indexer_heads or cfg.hc_count > 1:
        raise UserError(f"a split over several devices does not run {cfg.family} yet (its n-gram table, QSA "
                        "indexer or hyper-connection streams); use one device: --split-mode none")
    if ecfg.spec.mtp:
        raise UserError("--spec-type draft-mtp does not run with the layers split over several devices yet; use one "
                        "device (--split-mode none) or drop --spec-type")
    split = Split.by_shares(cfg.n_layers, [Device.resolve(n) for n in names], ecfg.placement.tensor_split)
    log.info("split: layers %s", split.describe())
    split.devices[0].make_current()         # where a forward begins (its batch's tensors, the sampler)
    return split


def _device_of(name: str, cfg: ModelConfig, dev: Device, split: Split | None) -> torch.device:
    """Where a dense tensor goes: a layer's to its layer's device, the embeddings to the first, the rest (the final
    norm, the lm_head) to the last."""
    if split is None:
        return dev.torch
    if name.startswith("blk."):
        return split.device(int(name.split(".")[1])).torch
    return split.devices[0 if name == "token_embd.weight" else -1].torch
